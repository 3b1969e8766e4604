#!/usr/bin/env bash
# Token trees on an accelerator, in one device call (< 9 minutes): the tree tests (greedy SD with a tree == AR,
# exact fake-model schedules; on a GPU the Triton body compiled with a tree mask against the reference, and the
# tiny model's tree steps through it), then chain vs a 16-node tree for SmolLM2 + smollm2-eagle at batch 1 and 16 on
# chat prompts, each without and with n-gram lookup (with it, the tree carries the copy branch: 20 nodes verified),
# interleaved, every tree step's attention on the Pallas body; then the nightjar planner offered the 60-node tree
# at γ_max beside chains. Tables go to stdout; JSON to $OUT/bench_spec_{tree,planner}_device.json (or ./).
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-.}"
python -c "import jax; print('backend', jax.default_backend(), jax.devices())"
JAX_PLATFORMS=cuda,cpu timeout 150 python -m pytest -q -p no:cacheprovider tests/spec/test_tree.py 2>&1 | tail -3 || true
timeout 240 python scripts/bench_spec.py --models smollm2-135m-instruct --chat --prompt-len 256 --tree-nodes 0,16 \
    --prompt-lookup 0,3 --batch-sizes 1,16 --gammas 2,4 --repeats 2 --output-len 64 \
    --out "${out_dir}/bench_spec_tree_device.json" || true
# the planner offered a 60-node tree at γ_max against chains: does it take the tree at batch 1 and leave it at 16?
exec timeout 150 python scripts/bench_spec.py --models smollm2-135m-instruct --planner nightjar --tree-nodes 0,60 \
    --tree-min-gamma 4 --batch-sizes 1,16 --repeats 2 --output-len 64 --out "${out_dir}/bench_spec_planner_device.json"
