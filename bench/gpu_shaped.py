"""Runs sweep scripts against a GPU-shaped Ray on a CPU machine: an embedded instance that declares
GPUs it does not have (Ray schedules by declared resources), so that the placement of packed and
DDP trials is exercised without a GPU.  One Ray start for several sweeps:

    python bench/gpu_shaped.py GPUS CPUS SCRIPT.py ARGS... [--next SCRIPT.py ARGS...]

Each sweep's exit status is printed as ``exit <name> <status>`` after its output.
"""

import runpy
import sys


def sweeps(argv: list[str]) -> list[tuple[str, list[str]]]:
    runs = [[]]
    for arg in argv:
        if arg == "--next":
            runs.append([])
        else:
            runs[-1].append(arg)
    return [(run[0], run[1:]) for run in runs if run]


def main() -> int:
    gpus, cpus, rest = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    from dpsm_ray.sweep.cli import main as sweep_main
    from dpsm_ray.train.ray_session import start_embedded

    start_embedded(num_cpus=cpus, num_gpus=gpus, worker_output=False)
    for script, args in sweeps(rest):
        module = runpy.run_path(script)  # its DEFAULTS and description, not its __main__ block
        name = script.rsplit("/", 1)[-1].removesuffix(".py")
        try:
            status = sweep_main(name, module["__doc__"].splitlines()[0], module["DEFAULTS"], args)
        except SystemExit as exit_:
            status = exit_.code
        print(f"exit {name} {status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
