"""Act: every signal the enforcer sends (SIGTERM/SIGKILL of a container over its share, SIGSTOP/SIGCONT
duty cycles) and the state files that let a restarted enforcer finish what it started."""
