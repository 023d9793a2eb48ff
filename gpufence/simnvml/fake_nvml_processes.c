/*
 * simnvml, continued: the per-device process lists, the run-state lag model and per-process
 * utilisation.  Included by fake_nvml.c where this section stood (one translation unit: it uses
 * that file's state, locking and helpers).
 */

/* ---- processes ---------------------------------------------------------------------------- */

/* version: 1 -> nvmlProcessInfo_v1_t, 2/3 -> nvmlProcessInfo_v2_t. */
static void lag_tick(const struct sim_proc *p, unsigned long long now);
static void lag_sampler_start(void);
static unsigned long long now_us(void);

static nvmlReturn_t do_running(const char *fn, int graphics, int version, nvmlDevice_t device, unsigned int *count,
                               void *infos) {
    struct sim_dev *d;
    nvmlReturn_t ret = enter_device(fn, device, &d);
    if (ret != NVML_SUCCESS) return ret;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long ns = caller_pidns();
    unsigned int n = 0;
    for (size_t i = 0; i < d->nprocs; i++)
        if (d->procs[i].graphics == graphics && visible_pid(&d->procs[i], ns)) n++;
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (!infos && n > 0) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int k = 0;
    for (size_t i = 0; i < d->nprocs; i++) {
        const struct sim_proc *p = &d->procs[i];
        unsigned int pid;
        if (p->graphics != graphics || !(pid = visible_pid(p, ns))) continue;
        lag_tick(p, now_us()); /* a process list is read every poll: the lag's clock between reads */
        if (version == 1) {
            nvmlProcessInfo_v1_t *o = (nvmlProcessInfo_v1_t *)infos + k;
            o->pid = pid;
            o->usedGpuMemory = p->used;
        } else {
            nvmlProcessInfo_v2_t *o = (nvmlProcessInfo_v2_t *)infos + k;
            o->pid = pid;
            o->usedGpuMemory = p->used;
            o->gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT; /* not a MIG device */
            o->computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
        }
        k++;
    }
    *count = k;
    return NVML_SUCCESS;
}

#define RUNNING(sym, graphics, version)                                                     \
    EXPORT nvmlReturn_t sym(nvmlDevice_t device, unsigned int *infoCount, void *infos) {     \
        LOCKED(do_running(#sym, graphics, version, device, infoCount, infos));              \
    }
RUNNING(nvmlDeviceGetComputeRunningProcesses_v3, 0, 3)
RUNNING(nvmlDeviceGetComputeRunningProcesses_v2, 0, 2)
RUNNING(nvmlDeviceGetComputeRunningProcesses, 0, 1)
RUNNING(nvmlDeviceGetGraphicsRunningProcesses_v3, 1, 3)
RUNNING(nvmlDeviceGetGraphicsRunningProcesses_v2, 1, 2)
RUNNING(nvmlDeviceGetGraphicsRunningProcesses, 1, 1)
RUNNING(nvmlDeviceGetMPSComputeRunningProcesses_v3, 2, 3)
RUNNING(nvmlDeviceGetMPSComputeRunningProcesses_v2, 2, 2)
RUNNING(nvmlDeviceGetMPSComputeRunningProcesses, 2, 1)

static unsigned long long now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
}

/* Utilisation that follows the process's run state with a lag. A GPU keeps executing the kernels a
 * process queued after the process is stopped, so its utilisation falls only gradually (and rises
 * gradually after SIGCONT): each process's SM use is its state-file value times an exponential
 * average (time constant util_lag_ms) of "running" (neither stopped by a signal nor frozen by the
 * cgroup freezer, read from /proc and cgroupfs every SAMPLE_PERIOD_US by lag_sampler and at each
 * process list and utilisation call). A utilisation read reports, as a real driver does, each
 * process's mean since the previous read (an H200 with driver 580: one record per process, its mean
 * over the samples since lastSeenTimeStamp), integrated over those samples. Kept across state
 * reloads, keyed by host PID. */
#define MAX_LAGGED 4096
static struct {
    unsigned int pid;
    double running;
    unsigned long long t_us;
    double sum;               /* SM% x microseconds since the previous utilisation read */
    unsigned long long since; /* that read's time */
} g_lagged[MAX_LAGGED];
static size_t g_nlagged;

/* The fields of <proc_dir>/stat from field 3 (the state letter) on, read into buf; NULL when the
 * process is gone. The command name, in parentheses, may hold spaces and ')': cut after the last. */
static const char *proc_stat_fields(const char *proc_dir, char *buf, size_t n) {
    char path[96];
    snprintf(path, sizeof path, "%s/stat", proc_dir);
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    size_t got = fread(buf, 1, n - 1, f);
    fclose(f);
    buf[got] = 0;
    char *close = strrchr(buf, ')');
    return close && close[1] == ' ' ? close + 2 : NULL;
}

/* The cgroup2 tree: /sys/fs/cgroup on a v2 host, /sys/fs/cgroup/unified on a hybrid one. */
static const char *cgroup2_root(void) {
    static const char *root;
    if (!root) root = access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/unified";
    return root;
}

/* Whether <root><cgroup>/<file> has a line starting with `want` (e.g. "frozen 1", "FROZEN"). */
static int cgroup_file_says(const char *root, const char *cgroup, const char *file, const char *want) {
    char path[CGROUP_PATH_MAX + 96], line[128];
    if (strcmp(cgroup, "/") == 0) return 0; /* the root is never frozen */
    if ((size_t)snprintf(path, sizeof path, "%s%s/%s", root, cgroup, file) >= sizeof path) return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int found = 0;
    while (!found && fgets(line, sizeof line, f)) found = strncmp(line, want, strlen(want)) == 0;
    fclose(f);
    return found;
}

/* Frozen by the cgroup freezer: a frozen task runs no instruction whatever signal it gets, so it
 * submits no GPU work, yet /proc shows it 'D' (v1) or 'S' (v2), never 'T'. Read from the cgroups of
 * /proc/<pid>/cgroup (the host's view, as the driver has it): v1's freezer.state (FROZEN, or
 * FREEZING: part of it stopped already; a parent's freeze shows in the child's state) and v2's
 * cgroup.events ("frozen 1", which an ancestor's cgroup.freeze sets too). */
static int proc_frozen(unsigned int pid) {
    char path[32], line[CGROUP_PATH_MAX + 64];
    snprintf(path, sizeof path, "/proc/%u/cgroup", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int frozen = 0;
    while (!frozen && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *controllers = strchr(line, ':');
        char *cgroup = controllers ? strchr(controllers + 1, ':') : NULL;
        if (!cgroup) continue;
        *controllers++ = 0;
        *cgroup++ = 0;
        if (strcmp(line, "0") == 0 && *controllers == 0) {
            frozen = cgroup_file_says(cgroup2_root(), cgroup, "cgroup.events", "frozen 1");
        } else {
            for (char *save = NULL, *c = strtok_r(controllers, ",", &save); c; c = strtok_r(NULL, ",", &save))
                if (strcmp(c, "freezer") == 0)
                    frozen = cgroup_file_says("/sys/fs/cgroup/freezer", cgroup, "freezer.state", "FROZEN") ||
                             cgroup_file_says("/sys/fs/cgroup/freezer", cgroup, "freezer.state", "FREEZING");
        }
    }
    fclose(f);
    return frozen;
}

/* Runnable: neither stopped by a signal (T, t) nor held by the cgroup freezer. */
static int proc_running(unsigned int pid) {
    char dir[32], buf[1024];
    snprintf(dir, sizeof dir, "/proc/%u", pid);
    const char *state = proc_stat_fields(dir, buf, sizeof buf);
    return state && *state != 'T' && *state != 't' && !proc_frozen(pid);
}

/* The process's slot, advanced to now (created running at its first call); MAX_LAGGED when full. */
static size_t lag_advance(const struct sim_proc *p, unsigned long long now) {
    size_t i;
    for (i = 0; i < g_nlagged && g_lagged[i].pid != p->host_pid; i++) {
    }
    lag_sampler_start();
    if (i == g_nlagged) {
        if (g_nlagged == MAX_LAGGED) return MAX_LAGGED;
        g_nlagged++;
        g_lagged[i].pid = p->host_pid;
        g_lagged[i].running = 1.0;
        g_lagged[i].t_us = g_lagged[i].since = now;
        g_lagged[i].sum = 0.0;
    }
    if (now <= g_lagged[i].t_us) return i;
    double dt_us = (double)(now - g_lagged[i].t_us);
    double tau = (double)g_state->util_lag_ms;
    double alpha = dt_us / 1000.0 / (tau + dt_us / 1000.0);
    double before = g_lagged[i].running;
    g_lagged[i].running += alpha * ((double)proc_running(p->host_pid) - before);
    g_lagged[i].sum += p->sm_util * (before + g_lagged[i].running) / 2.0 * dt_us; /* trapezoid */
    g_lagged[i].t_us = now;
    return i;
}

/* The driver samples every process's run state on its own clock, however often a caller reads: a
 * thread of the library, every SAMPLE_PERIOD_US while NVML is initialised, started with the first
 * lagged reading. Sampled only at the callers' reads, a caller polling at a steady phase of a duty
 * cycle (a throttle's period close to a multiple of its poll) would see that phase for many periods
 * and report a use the process did not have; a real driver's samples are the GPU's, not the caller's. */
static void *lag_sampler(void *arg) {
    (void)arg;
    for (;;) {
        usleep(SAMPLE_PERIOD_US);
        pthread_mutex_lock(&g_lock);
        if (g_state && g_state->util_lag_ms != 0 && g_init_count > 0) {
            unsigned long long now = now_us();
            for (size_t i = 0; i < g_state->ndevs; i++)
                for (size_t j = 0; j < g_state->devs[i].nprocs; j++) lag_advance(&g_state->devs[i].procs[j], now);
        }
        pthread_mutex_unlock(&g_lock);
    }
    return NULL;
}

static int g_sampler_started;

static void sampler_after_fork(void) { g_sampler_started = 0; } /* the child has no such thread */

static void lag_sampler_start(void) {
    if (g_sampler_started) return;
    g_sampler_started = 1;
    static int atfork;
    if (!atfork) atfork = pthread_atfork(NULL, NULL, sampler_after_fork) == 0;
    /* Every signal blocked in it: a process's signals (a Python program's handlers) go to its own threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_t attr;
    pthread_t thread;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&thread, &attr, lag_sampler, NULL) != 0) {
        g_sampler_started = 0;
        warn("cannot start the utilisation sampler thread; the run state is sampled at reads only");
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static void lag_tick(const struct sim_proc *p, unsigned long long now) {
    if (g_state->util_lag_ms != 0) lag_advance(p, now);
}

static unsigned int lagged_util(const struct sim_proc *p, unsigned long long now) {
    if (g_state->util_lag_ms == 0) return p->sm_util;
    size_t i = lag_advance(p, now);
    if (i == MAX_LAGGED) return p->sm_util;
    double elapsed = (double)(now - g_lagged[i].since);
    double mean = elapsed > 0 ? g_lagged[i].sum / elapsed : p->sm_util * g_lagged[i].running;
    g_lagged[i].sum = 0.0;
    g_lagged[i].since = now;
    return (unsigned int)(mean + 0.5);
}

static nvmlReturn_t do_process_utilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                           unsigned int *count, unsigned long long last_seen) {
    struct sim_dev *d;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetProcessUtilization", device, &d);
    if (ret != NVML_SUCCESS) return ret;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    /* The simulated driver takes one sample of every process on the device per period. */
    unsigned long long ts = now_us() / SAMPLE_PERIOD_US * SAMPLE_PERIOD_US;
    unsigned long long ns = caller_pidns();
    unsigned int n = 0;
    if (ts > last_seen)
        for (size_t i = 0; i < d->nprocs; i++)
            if (visible_pid(&d->procs[i], ns) && !duplicate_sample(d, i)) n++;
    if (n == 0) {
        *count = 0;
        return NVML_ERROR_NOT_FOUND;
    }
    if (!utilization || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int k = 0;
    for (size_t i = 0; i < d->nprocs; i++) {
        const struct sim_proc *p = &d->procs[i];
        unsigned int pid = visible_pid(p, ns);
        if (!pid || duplicate_sample(d, i)) continue;
        nvmlProcessUtilizationSample_t *o = &utilization[k++];
        o->pid = pid;
        o->timeStamp = ts;
        o->smUtil = lagged_util(p, now_us());
        o->memUtil = 0;
        o->encUtil = 0;
        o->decUtil = 0;
    }
    *count = k;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                    unsigned int *processSamplesCount,
                                                    unsigned long long lastSeenTimeStamp) {
    LOCKED(do_process_utilization(device, utilization, processSamplesCount, lastSeenTimeStamp));
}
