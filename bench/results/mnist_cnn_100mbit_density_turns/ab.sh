#!/bin/bash
# The density measured in turns (the installed gradshare) against in two stretches (the same package with
# gradshare/link.py of commit 49397b2), each seed's two runs back to back. Run from the repository root.
set -e
overlay=$(mktemp -d)
cp -r "$(python -c 'import gradshare, os; print(os.path.dirname(gradshare.__file__))')" "$overlay/"
git show 49397b2:python/gradshare/link.py > "$overlay/gradshare/link.py"
out=${OUT:-/tmp/density_ab_cnn}
for seed in 0 1 2; do
  for v in turns stretches; do
    if [ $v = stretches ]; then export PYTHONPATH=$overlay; else unset PYTHONPATH; fi
    python bench/e2e.py --workloads mnist_cnn --links 100mbit --seeds $seed --contenders gradshare_auto --train-subset 0 \
      --test-subset 0 --epochs 1 --eval-every 25 --target 0.95 --max-train-seconds 120 --timeout 500 \
      --out "$out/mnist_cnn_${v}_s$seed" | grep "seed $seed"
  done
done
