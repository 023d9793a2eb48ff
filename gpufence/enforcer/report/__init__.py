"""Report: what leaves the enforcer besides signals. The decision log, metrics, Kubernetes Events,
health over HTTP, and the driver's memory limits as the mechanism that holds each share."""
