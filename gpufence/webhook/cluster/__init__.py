"""The cluster I/O: what the core reads from the API server, kept in list-then-watch caches
(namespaces, nodes, DRA objects) and the policy ConfigMap. No API call per admission, but the fresh
read of a namespace the cache does not yet show as opted in."""
