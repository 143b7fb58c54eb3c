"""How torch's CPU threads wait for each other: chosen before torch is imported.

torch runs CPU operations on OpenMP threads that spin while they wait for each other. On an idle machine that
is the fastest; beside another busy process a spinning thread holds a core that the thread it waits for
needs, and every step slows (docs/troubleshooting.md). With OMP_WAIT_POLICY=PASSIVE a waiting thread sleeps.
OpenMP reads the policy once, when torch loads it, so the scripts call wait_passively_if_busy() before they
import torch. Standard library only.
"""

import os
import sys
import time

note = None  # the policy wait_passively_if_busy chose, in a line: device.setup says it on a CPU


def idle_cores(interval=0.1, read_stat=None):
    """(cores idle over the next `interval` seconds, the machine's cores), this process sleeping through it,
    from the kernel's CPU counters (/proc/stat, Linux); None where there are none to read."""
    def counters():
        try:
            if read_stat:
                text = read_stat()
            else:
                with open('/proc/stat') as f:
                    text = f.read()
        except OSError:
            return None
        lines = text.splitlines()
        fields = [int(v) for v in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        cores = sum(1 for line in lines[1:] if line.startswith('cpu'))
        return fields[3] + fields[4], sum(fields), cores
    first = counters()
    if first is None:
        return None
    time.sleep(interval)
    second = counters()
    if second is None:
        return None
    idle, total = second[0] - first[0], second[1] - first[1]
    return (second[2] * idle / total, second[2]) if total > 0 else None


def wait_passively_if_busy(measured=None):
    """Before torch is imported: OMP_WAIT_POLICY=PASSIVE when other processes keep half a core or more busy
    (measured: idle_cores()), so that torch's threads (as many as it would use anyway) sleep rather than spin
    while they wait. Left alone: an OMP_WAIT_POLICY the user set, OMP_NUM_THREADS=1 (one thread never waits),
    torch already imported (too late). Returns the one-line note it also keeps in `note`, or None."""
    global note
    if 'torch' in sys.modules or 'OMP_WAIT_POLICY' in os.environ or os.environ.get('OMP_NUM_THREADS') == '1':
        return None
    measured = idle_cores() if measured is None else measured
    if measured is None or measured[0] > measured[1] - 0.5:
        return None
    os.environ['OMP_WAIT_POLICY'] = 'PASSIVE'
    idle, cores = measured
    note = (f"CPU: {idle:.1f} of {cores} cores idle, so torch's threads sleep while they wait for each other "
            f"(OMP_WAIT_POLICY=PASSIVE; set it to choose)")
    return note
