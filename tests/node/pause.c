/* The node tests' pause image: PID 1 of each pod's sandbox (and of its shared PID namespace).
 * It must reap orphans (a PID-namespace init that does not leaves zombies the enforcer would see)
 * and exit on SIGTERM/SIGINT so the kubelet can stop the sandbox without SIGKILL. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (getpid() != 1) fprintf(stderr, "pause: warning: not PID 1\n");
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        perror("pause: sigaction");
        return 1;
    }
    for (;;) pause();
}
