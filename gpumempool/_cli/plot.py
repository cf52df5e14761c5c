"""``plot``: a memory snapshot (or a directory of per-rank snapshots) as an image."""

from __future__ import annotations

import argparse
import os
import pickle
from typing import Any, Optional

from .._summary import figure_label
from .._units import format_bytes
from . import common


def run(args: argparse.Namespace) -> int:
    import pickle

    from .._progress import Progress
    from ..plot import MissingDependencyError, require_matplotlib, plot_snapshot
    from ..trace import TraceFormatError

    try:  # before the progress bar: nothing can be drawn without it
        require_matplotlib()
    except MissingDependencyError as exc:
        return common.fail(str(exc), 2, json_out=args.json)
    if os.path.isdir(args.snapshot):
        return _plot_ranks(args)
    try:
        kind = common.file_kind(args.snapshot)
    except (OSError, ValueError) as exc:
        return common.fail(str(exc), json_out=args.json)
    if kind == "trace":
        return common.fail(f"{args.snapshot} is a gmptrace file; plot reads snapshot pickles "
                     "(gmp.dump_snapshot or torch.cuda.memory._dump_snapshot)", 2, json_out=args.json)
    error: Optional[tuple[str, int]] = None
    with Progress("plot", unit="ev", enabled=not (args.json or args.no_progress)) as bar:
        try:
            summary = plot_snapshot(args.snapshot, args.output, title=args.title,
                                    max_segments=args.max_segments, progress=bar)
        except MissingDependencyError as exc:
            error = (str(exc), 2)
        except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError) as exc:
            error = (str(exc), 1)
    if error is not None:  # reported once the bar is closed, so that it starts a line of its own
        return common.fail(error[0], error[1], json_out=args.json)
    if args.json:
        common.print_json(summary)
    else:
        print(f"wrote {summary['output']}: {summary['events']:,} history events, {summary['segments']:,} segments, "
              f"{summary['blocks']:,} blocks; {figure_label('peak_requested')} "
              f"{format_bytes(summary['peak_requested'])}, {figure_label('peak_reserved')} "
              f"{format_bytes(summary['peak_reserved'])}")
    return 0


def _plot_ranks(args: argparse.Namespace) -> int:
    """plot DIRECTORY: the ranks' snapshots (gpumempool.distributed.dump_snapshots) side by side."""
    from .._progress import Progress
    from ..plot import plot_ranks
    from ..trace import TraceFormatError

    error: Optional[str] = None
    with Progress("plot", unit="rank", enabled=not (args.json or args.no_progress)) as bar:
        try:
            summary = plot_ranks(args.snapshot, args.output, title=args.title, progress=bar)
        except (OSError, ValueError, pickle.UnpicklingError, TraceFormatError) as exc:
            error = str(exc)
    if error is not None:
        return common.fail(error, json_out=args.json)
    if args.json:
        common.print_json(summary)
        return 0
    peak = next(r for r in summary["ranks"] if r["rank"] == summary["peak_rank"])
    print(f"wrote {summary['output']}: {len(summary['ranks'])} ranks side by side; rank {peak['rank']} reserves the "
          f"most ({figure_label('peak_reserved')} {format_bytes(peak['peak_reserved'])}, "
          f"{figure_label('peak_requested')} {format_bytes(peak['peak_requested'])})")
    return 0


def add_parser(sub: Any) -> None:
    """Add the ``plot`` command to the subparsers ``sub``."""
    plot = sub.add_parser(
        "plot",
        help="plot a memory snapshot: allocated vs reserved over time and a segment map",
        description="Draw SNAPSHOT (a pickle from gmp.dump_snapshot or torch.cuda.memory._dump_snapshot, "
        "loaded without running any code in it) as an image: a timeline of allocated vs reserved bytes "
        "over the recorded history and a map of the segments with their blocks coloured by state. "
        "Needs matplotlib (pip install 'gpumempool[plot]').",
    )
    plot.add_argument("snapshot", metavar="SNAPSHOT",
                      help="snapshot pickle, or a directory of per-rank snapshots (gpumempool.distributed."
                      "dump_snapshots) to draw side by side")
    plot.add_argument("-o", "--output", required=True, metavar="OUT", help="image to write (.png, .svg, .pdf)")
    plot.add_argument("--title", help="figure title")
    plot.add_argument("--max-segments", type=common.positive, default=120, help="segments drawn at most (default 120)")
    plot.add_argument("--no-progress", action="store_true", help="no progress bar")
    plot.add_argument("--json", action="store_true", help="print a summary as JSON")
    plot.set_defaults(func=run)
