#include "cpu/parallel.h"
#include <stdexcept>
#include "gradshare/kernels.h"

namespace gs {

bool have_openmp() {
#ifdef GS_HAVE_OPENMP
  return true;
#else
  return false;
#endif
}

int cpu_threads() {
#ifdef GS_HAVE_OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_cpu_threads(int threads) {
  if (threads < 1) throw std::invalid_argument("threads must be >= 1");
#ifdef GS_HAVE_OPENMP
  omp_set_num_threads(threads);
#endif
}

}  // namespace gs
