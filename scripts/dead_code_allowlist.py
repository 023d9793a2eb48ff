"""Names in gpufence/ used only by name or reflection, so vulture cannot see their use
(scripts/dead_code.py). Each line is a use; say why."""

# ctypes: the driver reads the record's field (gpufence/enforcer/observe/nvml.py, nvmlGetMemoryLimits_v1).
_.nameSpace  # noqa: F821, B018
# prometheus_client calls a custom collector's collect() (gpufence/webhook/metrics.py).
_.collect  # noqa: F821, B018
# A console script (pyproject.toml's kubectl-gpufence).
_.kubectl_main  # noqa: F821, B018
# The node guardian's metric names as one tuple, read by its test and the monitor's (tests/unit/node).
_.NODE_METRICS  # noqa: F821, B018
# ssl.SSLContext reads its num_tickets when a TLS 1.3 handshake ends (gpufence/webhook/tls.py).
_.num_tickets  # noqa: F821, B018
