"""``python -m vpce.bench``: see ``vpce.bench`` for what is measured and how.

A ``--tp`` run leaves through ``os._exit`` once its output is written and flushed: its gloo process group object
is still referenced when ``main`` returns (the run's ``Env`` holds it, among others), so it was freed during
interpreter finalization, where a rank sometimes aborted ("terminate called without an active exception",
SIGABRT) after every line of its output, in ``tests/bench/test_bench_tp.py``'s ``--tp --distill`` run, also with a
barrier before ``destroy_process_group``.
"""

import os
import sys

from .cli import main

status = main()
if "--tp" in sys.argv[1:]:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)
sys.exit(status)
