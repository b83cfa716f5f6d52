"""`python -m infinity.deepspeed [--add-local-rank] [-m] SCRIPT [ARGS...]`: runs a training
script (with -m, a module, as `python -m` would) with `deepspeed` meaning infinity
([Note: the deepspeed alias] in infinity.deepspeed._alias). ARGS reach the script untouched;
`--add-local-rank` puts `--local_rank=$LOCAL_RANK` before them, as DeepSpeed's launcher does
(`infinity run` starts every rank this way under torchrun).

    python -m infinity.deepspeed train.py --deepspeed ds.json
    torchrun --nproc-per-node 2 -m infinity.deepspeed --add-local-rank train.py --deepspeed ds.json
"""

from __future__ import annotations

import os
import runpy
import sys

from infinity.deepspeed._alias import ENV, as_deepspeed

USAGE = "usage: python -m infinity.deepspeed [--add-local-rank] [-m] SCRIPT [ARGS...]"
_OPTIONS = ("--add-local-rank", "-m", "--module")


def _fail(message: str) -> None:
    print(f"{USAGE}\npython -m infinity.deepspeed: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    add_local_rank = module = False
    while argv and argv[0] in _OPTIONS:
        if argv.pop(0) == "--add-local-rank":
            add_local_rank = True
        else:
            module = True
    if not argv or argv[0].startswith("-"):
        _fail(f"expected SCRIPT (or -m MODULE) before the script's arguments, got {argv[0] if argv else 'nothing'}")
    target, rest = argv[0], argv[1:]
    if add_local_rank:
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank is None:
            _fail("--add-local-rank: LOCAL_RANK is not set (start this under torchrun or `infinity run`)")
        rest = [f"--local_rank={local_rank}", *rest]
    if not module and not os.path.isfile(target):
        _fail(f"SCRIPT {target}: not a file")
    as_deepspeed()
    os.environ[ENV] = "1"  # and in the processes the script starts ([Note: the alias from the environment])
    sys.argv = [target, *rest]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # as `python SCRIPT` does: the script's directory first on the path, for its own imports
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
