"""Tools around the engine, each run as `python scripts/NAME.py`: the llama.cpp comparison
(vs_llamacpp.sh, make_gguf.py, peers_table.py), the format report (format_report.py), the KVmix
planner (kvmix_plan.py) and the GPU batch runner (gpu_run.sh). A package only so tests can import them."""
