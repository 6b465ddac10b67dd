/*
 * pause: the Kubernetes pod sandbox process (image dscache.local/pause).
 *
 * Contract:
 *   - Holds the pod's namespaces open by doing nothing: it sleeps in
 *     sigsuspend(2) until a signal arrives, using no CPU. The signals are
 *     blocked outside sigsuspend, so one that arrives between the check and
 *     the sleep is not lost.
 *   - SIGINT or SIGTERM: exits 0 (the runtime stops a sandbox with SIGTERM
 *     first, so a clean stop is never a SIGKILL).
 *   - SIGCHLD: reaps every exited child. With a shared PID namespace the
 *     sandbox is PID 1 and inherits orphans; without reaping they would stay
 *     zombies.
 *   - "-v" prints the version and exits 0. Any other argument is an error.
 *
 * Built with gcc -static -Os (images/Dockerfile, stage pause-build); needs
 * nothing from the image it runs in, so that image holds this file alone.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define PAUSE_VERSION "1.0"

static volatile sig_atomic_t stop_signal = 0;

static void on_stop(int signum) { stop_signal = signum; }

static void on_child(int signum) {
    (void)signum;
    int saved = errno; /* a handler must not clobber the interrupted code's errno */
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static int install(int signum, void (*handler)(int)) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = handler;
    sigemptyset(&action.sa_mask);
    /* SA_NOCLDSTOP: stopped (not exited) children need no wake-up. */
    action.sa_flags = signum == SIGCHLD ? SA_NOCLDSTOP | SA_RESTART : 0;
    return sigaction(signum, &action, NULL);
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "-v") == 0) {
        printf("pause (dscache) %s\n", PAUSE_VERSION);
        return 0;
    }
    if (argc > 1) {
        fprintf(stderr, "usage: %s [-v]\n", argv[0]);
        return 2;
    }
    if (getpid() != 1) {
        fprintf(stderr, "pause: warning: not running as PID 1\n");
    }
    sigset_t handled, waiting;
    sigemptyset(&handled);
    sigaddset(&handled, SIGINT);
    sigaddset(&handled, SIGTERM);
    sigaddset(&handled, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &handled, &waiting) != 0 || install(SIGINT, on_stop) != 0 ||
        install(SIGTERM, on_stop) != 0 || install(SIGCHLD, on_child) != 0) {
        perror("pause: signal setup");
        return 1;
    }
    sigdelset(&waiting, SIGINT);
    sigdelset(&waiting, SIGTERM);
    sigdelset(&waiting, SIGCHLD);
    while (!stop_signal) {
        sigsuspend(&waiting); /* returns -1/EINTR after each handled signal */
    }
    fprintf(stderr, "pause: shutting down, got signal %d\n", (int)stop_signal);
    return 0;
}
