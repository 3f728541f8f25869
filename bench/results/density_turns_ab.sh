#!/bin/bash
# The density measured in turns (the installed gradshare) against in two stretches (the same package with
# gradshare/link.py of commit 49397b2), each seed's two runs back to back, at 100 Mbit/s, 3 seeds.
# Run from the repository root: bash bench/results/density_turns_ab.sh mlp|mnist_cnn OUT_DIR
set -e
workload=$1 out=$2
case $workload in
  mlp) args="--train-subset 12000 --target 0.9 --max-train-seconds 300" ;;
  mnist_cnn) args="--train-subset 0 --target 0.95 --max-train-seconds 120" ;;
  *) echo "usage: $0 mlp|mnist_cnn OUT_DIR" >&2; exit 2 ;;
esac
overlay=$(mktemp -d)
cp -r "$(python -c 'import gradshare, os; print(os.path.dirname(gradshare.__file__))')" "$overlay/"
git show 49397b2:python/gradshare/link.py > "$overlay/gradshare/link.py"
for seed in 0 1 2; do
  for v in turns stretches; do
    if [ $v = stretches ]; then export PYTHONPATH=$overlay; else unset PYTHONPATH; fi
    python bench/e2e.py --workloads "$workload" --links 100mbit --seeds $seed --contenders gradshare_auto $args \
      --test-subset 0 --epochs 1 --eval-every 25 --timeout 500 --out "$out/${workload}_${v}_s$seed" | grep "seed $seed"
  done
done
