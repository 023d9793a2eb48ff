"""The cluster I/O: watch caches of what the core reads from the API server (namespaces, nodes, DRA
objects) and the policy ConfigMap; never an API call per admission but a namespace's fresh read."""
