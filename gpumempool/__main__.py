"""Command line: ``python -m gpumempool {info,demo,replay,tune,oracle,plot,bench}``.

Every command has ``--help``; ``--json`` prints machine-readable output;
long work shows a progress bar on stderr unless ``--json`` or
``--no-progress``. Each command lives in its own module of
:mod:`gpumempool._cli`; this module builds the parser from them and runs
the command, turning bad input and the library's errors into one line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import sys
import zlib
from typing import Optional, Sequence

from ._cli import bench, common, demo, info, oracle, plot, replay, tune


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=common.prog(), description="gpumempool command line")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (info, demo, replay, tune, oracle, plot, bench):
        command.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ._errors import GpuMemPoolError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`... --json | head`): nothing more to say to
        # it, and nothing for Python to complain about when it flushes stdout
        # at exit. 141 is what a shell reports for SIGPIPE.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OSError, ValueError, ArithmeticError, RecursionError, EOFError, pickle.PickleError, zlib.error,
            MemoryError, GpuMemPoolError) as exc:
        # Bad input the command did not report itself, or the library's
        # errors (out of memory, a backend's failure): an error, not a traceback.
        return common.fail(f"{type(exc).__name__}: {str(exc)[:500]}", json_out=bool(getattr(args, "json", False)))


if __name__ == "__main__":
    sys.exit(main())
