/*
 * simnvml, continued: the per-device process lists, the run-state lag model and per-process
 * utilisation.  Included by fake_nvml.c where this section stood (one translation unit: it uses
 * that file's state, locking and helpers).
 */

/* ---- processes ---------------------------------------------------------------------------- */

/* version: 1 -> nvmlProcessInfo_v1_t, 2/3 -> nvmlProcessInfo_v2_t. */
static void lag_tick(const struct sim_proc *p, unsigned long long now);
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
 * average (time constant util_lag_ms) of "running" (not stopped, read from /proc at each process
 * list and utilisation call). A utilisation read reports, as a real driver does, each process's
 * mean since the previous read (an H200 with driver 580: one record per process, its mean over the
 * samples since lastSeenTimeStamp), integrated over those calls. Kept across state reloads, keyed
 * by host PID. */
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

static int proc_running(unsigned int pid) {
    char dir[32], buf[1024];
    snprintf(dir, sizeof dir, "/proc/%u", pid);
    const char *state = proc_stat_fields(dir, buf, sizeof buf);
    return state && *state != 'T' && *state != 't';
}

/* The process's slot, advanced to now (created running at its first call); MAX_LAGGED when full. */
static size_t lag_advance(const struct sim_proc *p, unsigned long long now) {
    size_t i;
    for (i = 0; i < g_nlagged && g_lagged[i].pid != p->host_pid; i++) {
    }
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
