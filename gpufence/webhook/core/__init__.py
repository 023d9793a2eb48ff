"""The pure core: an AdmissionReview in, a decision and a JSON Patch out (no I/O, no clock reads):
the pod's shape, its GPU paths, the shares and their bounds, the desired pod, the patch."""
