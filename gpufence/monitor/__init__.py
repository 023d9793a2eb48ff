"""Monitoring from the operator's side: ``gpufence top`` and ``gpufence recommend`` (gpufence/monitor/cli.py).

Reads the enforcer's metrics (names: gpufence/metric_names.py) from Prometheus or through the API
server; imports neither the webhook nor the enforcer.
"""
