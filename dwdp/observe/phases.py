"""Names of the phases of one forward, shared by NVTX ranges, Chrome traces and the trace scripts.

Changing a name here changes it everywhere; the trace readers match on these strings.
"""
FORWARD = "dwdp/forward"
ATTENTION = "dwdp/attention"
ROUTER = "dwdp/router"
MOE_COMPUTE = "dwdp/moe_compute"
PREFETCH_ISSUE = "dwdp/prefetch_issue"
PREFETCH_WAIT = "dwdp/prefetch_wait"
COPY_SLICE = "dwdp/copy_slice"

ALL = (FORWARD, ATTENTION, ROUTER, MOE_COMPUTE, PREFETCH_ISSUE, PREFETCH_WAIT, COPY_SLICE)
