"""The worker process of :func:`gpumempool.tune.tune`: loads a trace once,
then replays each line of settings (JSON) it reads on stdin and writes the
result as a JSON line on stdout."""

import sys

from gpumempool._tune_run import worker_main

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m gpumempool._tune_worker TRACE '[LIMIT, CAPACITY]' (started by gpumempool.tune)")
    sys.exit(worker_main(sys.argv[1], sys.argv[2]))
