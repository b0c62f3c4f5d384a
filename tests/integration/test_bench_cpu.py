"""The cluster benchmark's CPU meter: CPU seconds by role, each with its descendants."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from kvtier.bench.cluster.cpu_usage import CpuMeter

# A parent that only waits for its child, which spins until it has used 2 s of CPU.
SPIN = "import time\nwhile time.process_time() < 2: pass"
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])"


def test_cpu_is_counted_with_descendants_but_not_for_roles_alone() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # both started (what they used before start() does not count)
        roles = {"tree": [parent.pid], "parent alone": [parent.pid], "idle": [idle.pid]}
        meter = CpuMeter(roles, alone=("parent alone",))
        meter.start()
        deadline = time.monotonic() + 30
        while (cpu := meter.stop())["tree"] < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cpu["tree"] >= 0.5  # the grandchild's spinning, counted under the parent
        assert cpu["parent alone"] < 0.2 and cpu["idle"] < 0.2  # both only wait
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the spinner too
        idle.kill()
        parent.wait()
        idle.wait()
