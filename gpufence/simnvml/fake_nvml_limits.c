/*
 * simnvml, continued: NVML R615's per-cgroup GPU memory limits and the simulated allocations they
 * limit.  Included at the end of fake_nvml.c (one translation unit: it uses that file's state,
 * locking and helpers).
 *
 * What the driver does, from its source (NVIDIA/open-gpu-kernel-modules, 615.x,
 * src/nvidia/src/kernel/mem_mgr/memacct.c, the cgroup-v2 "fallback" accounting):
 *   - limits are kept per GPU and per cgroup; an allocation is charged to the nearest cgroup, the
 *     process's own or an ancestor, that has limits on that GPU, and fails past its hard limit;
 *   - get answers the nearest limited cgroup's limits and its current use, and NOT_SUPPORTED when
 *     neither the cgroup nor any ancestor has limits on that GPU;
 *   - set refuses the root cgroup (NOT_SUPPORTED, "to match dmem") and a hard limit below what an
 *     already limited cgroup holds (the driver's NV_ERR_INVALID_LIMIT; reported here as
 *     INVALID_ARGUMENT: the NVML code it maps to is not in the open source);
 *   - soft 0 / hard NVML_DEVICE_MEMORY_LIMIT_MAX is "no limit" (NVML API reference,
 *     nvmlSetMemoryLimits_v1_t / nvmlGetMemoryLimits_v1_t); the driver stores it like any other
 *     limit, so it also stops an ancestor's limit from applying.
 * Assumed, not found in a source: a NULL struct, or a NULL, empty or relative nameSpace, and a
 * soft limit above the hard one are INVALID_ARGUMENT (the kernel does not check soft <= hard; the
 * toolkit's hook refuses request > limit before it calls NVML).  The real setter needs root and
 * opens the cgroup directory; the simulation checks neither (this machine mounts cgroup v1, where
 * the v2 paths do not exist).  The real driver counts only what was charged while a limit existed;
 * here currentUsed is what the processes in the cgroup hold, whenever they took it.
 *
 * Persistence: limits and allocations must be seen by every process that loads the library (the
 * container toolkit's hook sets them, the enforcer reads them, workloads allocate), so they live in
 * "<state file>.driver", never in the state file the test writes:
 *
 *     gpufence-simnvml-driver 1
 *     limit <uuid> <soft> <hard> <namespace>
 *     alloc <uuid> <host pid, 0 if unknown> <bytes> <allocator's pid ns inode> <its pid there> <its start time>
 *
 * Writers hold flock(LOCK_EX) on "<state file>.driver.lock", re-read the file, and replace it
 * (temp file + rename); readers read it without the lock at every call.
 */
#include <fcntl.h>
#include <sys/file.h>

#define LEDGER_SUFFIX ".driver"
#define LEDGER_MAGIC "gpufence-simnvml-driver 1"
#define CGROUP_ROOT "/sys/fs/cgroup"
#define NVML_DEVICE_MEMORY_LIMIT_MAX 0xFFFFFFFFFFFFFFFFULL

/*
 * nvml.h (CUDA 13 / R615) and pynvml 13.615.71 agree: no version field, a const char * and
 * unsigned long long fields (pynvml: c_char_p and c_ulonglong, which ctypes shows as c_ulong on
 * 64-bit Linux): 24 and 32 bytes on x86_64.
 */
typedef struct {
    const char *nameSpace;        /* [in] full path of the cgroup directory, e.g. /sys/fs/cgroup/<path> */
    unsigned long long softLimit; /* [in] bytes */
    unsigned long long hardLimit; /* [in] bytes */
} nvmlSetMemoryLimits_v1_t;

typedef struct {
    const char *nameSpace;          /* [in] */
    unsigned long long softLimit;   /* [out] */
    unsigned long long hardLimit;   /* [out] */
    unsigned long long currentUsed; /* [out] */
} nvmlGetMemoryLimits_v1_t;

_Static_assert(sizeof(nvmlSetMemoryLimits_v1_t) == 24, "nvmlSetMemoryLimits_v1_t layout");
_Static_assert(sizeof(nvmlGetMemoryLimits_v1_t) == 32, "nvmlGetMemoryLimits_v1_t layout");

struct sim_limit {
    char uuid[96];
    char *ns; /* normalised: no trailing '/' */
    unsigned long long soft, hard;
};

struct sim_alloc {
    char uuid[96];
    unsigned int pid; /* host pid: the state file lists the allocator or it runs in the host pid ns; else 0 */
    unsigned long long bytes;
    unsigned long long ns_inode; /* the allocator's pid namespace and its pid there */
    unsigned int ns_pid;
    /* The allocator's start time (clock ticks after boot, field 22 of /proc/<pid>/stat; 0: unknown).
     * A pid, even with its namespace's inode, names a process only until both are reused: a later
     * pod's namespace can get a dead one's inode and the same small pids, and would inherit its
     * allocations without this. */
    unsigned long long start;
};

struct ledger {
    struct sim_limit *limits;
    size_t nlimits, limcap;
    struct sim_alloc *allocs;
    size_t nallocs, alloccap;
};

static struct ledger g_ledger;
static char *g_ledger_text; /* the file as last read: the view is rebuilt when it changes */

static void free_ledger(struct ledger *l) {
    for (size_t i = 0; i < l->nlimits; i++) free(l->limits[i].ns);
    free(l->limits);
    free(l->allocs);
    memset(l, 0, sizeof *l);
}

static void ledger_path(const char *state_path, const char *suffix, char *out, size_t n) {
    snprintf(out, n, "%s%s%s", state_path, LEDGER_SUFFIX, suffix);
}

/* The whole file (malloc'd, NUL-terminated); "" when it does not exist; NULL on other errors. */
static char *read_text(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return errno == ENOENT ? strdup("") : NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + n, 1, cap - n - 1, f)) > 0;) {
        n += got;
        if (cap - n - 1 == 0) {
            char *bigger = realloc(buf, cap *= 2);
            if (!bigger) free(buf);
            buf = bigger;
        }
    }
    fclose(f);
    if (buf) buf[n] = 0;
    return buf;
}

/* Normalises a namespace path into out: absolute, no trailing '/'. -1: NULL, empty, relative, too long. */
static int normalise_ns(const char *ns, char *out, size_t n) {
    if (!ns || ns[0] != '/') return -1;
    size_t len = strlen(ns);
    while (len > 1 && ns[len - 1] == '/') len--;
    if (len >= n) return -1;
    memcpy(out, ns, len);
    out[len] = 0;
    return 0;
}

static int parse_ledger(const char *text, struct ledger *l) {
    char *copy = strdup(text), *save_line = NULL;
    int lineno = 0;
    memset(l, 0, sizeof *l);
    if (!copy) return -1;
    for (char *line = strtok_r(copy, "\n", &save_line); line; line = strtok_r(NULL, "\n", &save_line)) {
        char *save = NULL, *kw;
        if (++lineno == 1) {
            if (strcmp(line, LEDGER_MAGIC) != 0) goto bad;
            continue;
        }
        if (!(kw = strtok_r(line, " ", &save))) continue;
        char *uuid = strtok_r(NULL, " ", &save);
        if (!uuid || strlen(uuid) >= sizeof l->limits[0].uuid) goto bad;
        if (strcmp(kw, "limit") == 0) {
            struct sim_limit lim = {0};
            char nsbuf[CGROUP_PATH_MAX];
            if (parse_ull(strtok_r(NULL, " ", &save), &lim.soft)) goto bad;
            if (parse_ull(strtok_r(NULL, " ", &save), &lim.hard)) goto bad;
            if (normalise_ns(strtok_r(NULL, "", &save), nsbuf, sizeof nsbuf)) goto bad;
            if (grow((void **)&l->limits, &l->limcap, l->nlimits, sizeof lim) || !(lim.ns = strdup(nsbuf))) goto bad;
            strcpy(lim.uuid, uuid);
            l->limits[l->nlimits++] = lim;
        } else if (strcmp(kw, "alloc") == 0) {
            struct sim_alloc a = {0};
            unsigned long long pid, nspid;
            if (parse_ull(strtok_r(NULL, " ", &save), &pid) || pid > 0xFFFFFFFFULL) goto bad;
            if (parse_ull(strtok_r(NULL, " ", &save), &a.bytes)) goto bad;
            if (parse_ull(strtok_r(NULL, " ", &save), &a.ns_inode)) goto bad;
            if (parse_ull(strtok_r(NULL, " ", &save), &nspid) || nspid > 0xFFFFFFFFULL) goto bad;
            char *start = strtok_r(NULL, " ", &save); /* absent in ledgers written before it was kept */
            if (start && parse_ull(start, &a.start)) goto bad;
            if (grow((void **)&l->allocs, &l->alloccap, l->nallocs, sizeof a)) goto bad;
            strcpy(a.uuid, uuid);
            a.pid = (unsigned int)pid;
            a.ns_pid = (unsigned int)nspid;
            l->allocs[l->nallocs++] = a;
        } else {
            goto bad;
        }
    }
    free(copy);
    return 0;
bad:
    free(copy);
    free_ledger(l);
    return -1;
}

/* Atomically replaces the ledger file (the caller holds the ledger lock). */
static int write_ledger(const char *state_path, const struct ledger *l) {
    char path[4200], tmp[4300];
    ledger_path(state_path, "", path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    fprintf(f, "%s\n", LEDGER_MAGIC);
    for (size_t i = 0; i < l->nlimits; i++)
        fprintf(f, "limit %s %llu %llu %s\n", l->limits[i].uuid, l->limits[i].soft, l->limits[i].hard,
                l->limits[i].ns);
    for (size_t i = 0; i < l->nallocs; i++)
        fprintf(f, "alloc %s %u %llu %llu %u %llu\n", l->allocs[i].uuid, l->allocs[i].pid, l->allocs[i].bytes,
                l->allocs[i].ns_inode, l->allocs[i].ns_pid, l->allocs[i].start);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* Field 22 of <proc_dir>/stat (the process's start time in clock ticks after boot); 0 when unreadable. */
static unsigned long long proc_start_ticks(const char *proc_dir) {
    char buf[1024];
    const char *field = proc_stat_fields(proc_dir, buf, sizeof buf); /* field 3 */
    for (int i = 3; i < 22 && field; i++)
        if ((field = strchr(field, ' '))) field++;
    return field ? strtoull(field, NULL, 10) : 0;
}

/* An allocation whose process has exited is gone, as the driver frees a dead process's memory.
 * Decidable from the allocator's own pid namespace, or from the host's when its host pid is known;
 * elsewhere it is taken as alive. */
static int alloc_alive(const struct sim_alloc *a) {
    char path[64];
    unsigned long long ns = caller_pidns();
    if (ns == a->ns_inode) snprintf(path, sizeof path, "/proc/%u", a->ns_pid);
    else if (a->pid && ns == g_base->host_ns) snprintf(path, sizeof path, "/proc/%u", a->pid);
    else return 1;
    if (a->start) return proc_start_ticks(path) == a->start; /* same pid, same process */
    return access(path, F_OK) == 0;
}

static struct sim_dev *dev_by_uuid(struct sim_state *s, const char *uuid) {
    for (size_t i = 0; i < s->ndevs; i++)
        if (strcmp(s->devs[i].uuid, uuid) == 0) return &s->devs[i];
    return NULL;
}

/* g_base plus the ledger's allocations: a listed process's usage grows by what it allocated; an
 * allocating process the state file does not list is added as a compute process. */
static struct sim_state *build_view(const struct sim_state *base, const struct ledger *l) {
    struct sim_state *v = malloc(sizeof *v);
    if (!v) return NULL;
    *v = *base;
    v->fails = NULL;
    v->ndevs = 0; /* counts the devices copied so far, so that free_state() frees no more */
    v->devs = calloc(base->ndevs ? base->ndevs : 1, sizeof *v->devs);
    if (base->nfails) v->fails = malloc(base->nfails * sizeof *v->fails);
    if (!v->devs || (base->nfails && !v->fails)) goto fail;
    v->devcap = base->ndevs;
    v->failcap = base->nfails;
    if (base->nfails) memcpy(v->fails, base->fails, base->nfails * sizeof *v->fails);
    for (size_t i = 0; i < base->ndevs; i++) {
        struct sim_dev *d = &v->devs[v->ndevs++];
        *d = base->devs[i];
        d->procs = NULL;
        d->cap = d->nprocs = 0;
        for (size_t j = 0; j < base->devs[i].nprocs; j++) {
            if (grow((void **)&d->procs, &d->cap, d->nprocs, sizeof *d->procs)) goto fail;
            struct sim_proc *p = &d->procs[d->nprocs++];
            *p = base->devs[i].procs[j];
            if (p->cgroup && !(p->cgroup = strdup(p->cgroup))) goto fail;
        }
    }
    for (size_t k = 0; k < l->nallocs; k++) {
        const struct sim_alloc *a = &l->allocs[k];
        struct sim_dev *d = dev_by_uuid(v, a->uuid);
        if (!d || !alloc_alive(a)) continue;
        struct sim_proc *p = NULL;
        for (size_t j = 0; j < d->nprocs && !p && a->pid; j++)
            if (d->procs[j].host_pid == a->pid) p = &d->procs[j];
        if (!p) { /* host pid unknown (a nested pid namespace): listed under its own pid */
            if (grow((void **)&d->procs, &d->cap, d->nprocs, sizeof *d->procs)) goto fail;
            p = &d->procs[d->nprocs++];
            memset(p, 0, sizeof *p);
            p->host_pid = a->pid ? a->pid : a->ns_pid;
            p->has_ns = 1;
            p->ns_inode = a->ns_inode;
            p->ns_pid = a->ns_pid;
        }
        p->charged += a->bytes;
        if (p->used != NVML_VALUE_NOT_AVAILABLE_ULL) p->used += a->bytes;
    }
    return v;
fail:
    free_state(v);
    return NULL;
}

/*
 * Re-reads the ledger (every call: it is small and written by other processes) and rebuilds g_state
 * from g_base when either changed or allocations are recorded.  A malformed ledger keeps the last
 * good one.  Caller holds g_lock.
 */
static int refresh_view(const char *state_path, int base_changed, int force) {
    char path[4200];
    ledger_path(state_path, "", path, sizeof path);
    char *text = read_text(path);
    int ledger_changed = text && (!g_ledger_text || strcmp(text, g_ledger_text) != 0);
    if (ledger_changed) {
        struct ledger l;
        if (parse_ledger(text, &l) == 0) {
            free_ledger(&g_ledger);
            g_ledger = l;
        } else {
            warn("%s is malformed; keeping the limits and allocations read before", path);
        }
        free(g_ledger_text);
        g_ledger_text = text;
    } else {
        free(text);
    }
    /* With allocations recorded, rebuild anyway: one whose process exited no longer counts. */
    if (g_state && !base_changed && !ledger_changed && !force && g_ledger.nallocs == 0) return 0;
    struct sim_state *v = build_view(g_base, &g_ledger);
    if (!v) return g_state ? 0 : -1;
    free_state(g_state);
    g_state = v;
    return 0;
}

/* ---- cgroups ------------------------------------------------------------------------------ */

/*
 * The cgroup namespace NVML names for a process, from the text of /proc/<pid>/cgroup: the unified
 * hierarchy's line "0::/<path>" gives "/sys/fs/cgroup/<path>" ("0::/" gives "/sys/fs/cgroup").
 * -1 when there is no such line.  gpufence.simnvml.cgroup_namespace() is the same rule in Python.
 */
static int namespace_from_cgroup_file(const char *text, char *out, size_t n) {
    for (const char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (strncmp(line, "0::/", 4) != 0) continue;
        const char *path = line + 3;
        size_t len = strcspn(path, "\n");
        while (len > 1 && path[len - 1] == '/') len--;
        if (len == 1) return snprintf(out, n, "%s", CGROUP_ROOT) < (int)n ? 0 : -1;
        return snprintf(out, n, "%s%.*s", CGROUP_ROOT, (int)len, path) < (int)n ? 0 : -1;
    }
    return -1;
}

/* The namespace of a process of the view: the state file's cgroup, else from /proc/<pid>/cgroup
 * (pid "self" for the caller); -1 when unknown (never limited, as the driver charges nothing for a
 * process without a cgroup). */
static int proc_namespace(const struct sim_proc *p, const char *pid, char *out, size_t n) {
    if (p && p->cgroup) return normalise_ns(p->cgroup, out, n);
    char path[64];
    if (pid) snprintf(path, sizeof path, "/proc/%s/cgroup", pid);
    else snprintf(path, sizeof path, "/proc/%u/cgroup", p->host_pid);
    char *text = read_text(path);
    int ret = text && *text ? namespace_from_cgroup_file(text, out, n) : -1;
    free(text);
    return ret;
}

static int ns_within(const char *ns, const char *ancestor) {
    size_t len = strlen(ancestor);
    return strncmp(ns, ancestor, len) == 0 && (ns[len] == 0 || ns[len] == '/' || (len == 1 && ancestor[0] == '/'));
}

/* The limits that apply to namespace ns on device uuid: the nearest limited ancestor-or-self. */
static const struct sim_limit *limiting(const char *uuid, const char *ns) {
    const struct sim_limit *best = NULL;
#ifndef SIMNVML_NO_MEMORY_LIMITS
    for (size_t i = 0; i < g_ledger.nlimits; i++) {
        const struct sim_limit *l = &g_ledger.limits[i];
        if (strcmp(l->uuid, uuid) == 0 && ns_within(ns, l->ns) && (!best || strlen(l->ns) > strlen(best->ns)))
            best = l;
    }
#else
    (void)uuid;
    (void)ns;
    (void)ns_within; /* the old driver has no limits */
#endif
    return best;
}

/* What the processes charged to limits L hold on device d. */
static unsigned long long group_used(const struct sim_dev *d, const struct sim_limit *L) {
    unsigned long long used = 0;
    char ns[CGROUP_PATH_MAX];
    for (size_t i = 0; i < d->nprocs; i++)
        if (proc_namespace(&d->procs[i], NULL, ns, sizeof ns) == 0 && limiting(d->uuid, ns) == L)
            used += proc_bytes(&d->procs[i]);
    return used;
}

/* ---- writers: the ledger lock ---------------------------------------------------------------- */

/* Takes the ledger lock and re-reads the ledger and view; returns the lock's fd, or -1. */
static int ledger_lock(void) {
    const char *state_path = getenv(STATE_ENV);
    char path[4200];
    if (!state_path || !*state_path) return -1;
    ledger_path(state_path, ".lock", path, sizeof path);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        warn("cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    while (flock(fd, LOCK_EX) != 0)
        if (errno != EINTR) {
            close(fd);
            return -1;
        }
    if (refresh_view(state_path, 0, 1) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Writes l as the new ledger, refreshes the view and drops the lock. */
static nvmlReturn_t ledger_commit(int fd, const struct ledger *l) {
    const char *state_path = getenv(STATE_ENV);
    nvmlReturn_t ret = NVML_SUCCESS;
    if (write_ledger(state_path, l) != 0) {
        warn("cannot write the limits and allocations beside %s: %s", state_path, strerror(errno));
        ret = NVML_ERROR_UNKNOWN;
    }
    refresh_view(state_path, 0, 1);
    close(fd);
    return ret;
}

/* ---- NVML: nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1 ------------------------- */

#ifndef SIMNVML_NO_MEMORY_LIMITS
static nvmlReturn_t do_set_limits(nvmlDevice_t device, const nvmlSetMemoryLimits_v1_t *req) {
    struct sim_dev *d;
    char ns[CGROUP_PATH_MAX];
    nvmlReturn_t ret = enter_device("nvmlDeviceSetMemoryLimits_v1", device, &d);
    if (ret != NVML_SUCCESS) return ret;
    if (!req || normalise_ns(req->nameSpace, ns, sizeof ns) != 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (req->softLimit > req->hardLimit) return NVML_ERROR_INVALID_ARGUMENT;
    if (strcmp(ns, CGROUP_ROOT) == 0 || !ns_within(ns, CGROUP_ROOT)) return NVML_ERROR_NOT_SUPPORTED;
    size_t index = (size_t)(d - g_state->devs);
    int fd = ledger_lock();
    if (fd < 0) return NVML_ERROR_UNKNOWN;
    if (index >= g_state->ndevs) { /* the state file changed under us: the device is gone */
        close(fd);
        return NVML_ERROR_GPU_IS_LOST;
    }
    d = &g_state->devs[index];
    struct sim_limit *existing = NULL;
    for (size_t i = 0; i < g_ledger.nlimits && !existing; i++)
        if (strcmp(g_ledger.limits[i].uuid, d->uuid) == 0 && strcmp(g_ledger.limits[i].ns, ns) == 0)
            existing = &g_ledger.limits[i];
    if (existing && group_used(d, existing) > req->hardLimit) {
        close(fd);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (!existing) {
        char *copy = strdup(ns);
        if (!copy || grow((void **)&g_ledger.limits, &g_ledger.limcap, g_ledger.nlimits, sizeof *existing)) {
            free(copy);
            close(fd);
            return NVML_ERROR_UNKNOWN;
        }
        existing = &g_ledger.limits[g_ledger.nlimits++];
        snprintf(existing->uuid, sizeof existing->uuid, "%s", d->uuid);
        existing->ns = copy;
    }
    existing->soft = req->softLimit;
    existing->hard = req->hardLimit;
    return ledger_commit(fd, &g_ledger);
}

static nvmlReturn_t do_get_limits(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *req) {
    struct sim_dev *d;
    char ns[CGROUP_PATH_MAX];
    nvmlReturn_t ret = enter_device("nvmlDeviceGetMemoryLimits_v1", device, &d);
    if (ret != NVML_SUCCESS) return ret;
    if (!req || normalise_ns(req->nameSpace, ns, sizeof ns) != 0) return NVML_ERROR_INVALID_ARGUMENT;
    const struct sim_limit *L = limiting(d->uuid, ns);
    if (!L) return NVML_ERROR_NOT_SUPPORTED;
    req->softLimit = L->soft;
    req->hardLimit = L->hard;
    req->currentUsed = group_used(d, L);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits) {
    LOCKED(do_set_limits(device, limits));
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits) {
    LOCKED(do_get_limits(device, limits));
}
#endif

/* ---- the simulated workload's allocations ------------------------------------------------------ */

/*
 * simnvmlAllocate(uuid, bytes): what a CUDA allocation does to the driver's accounting.  The caller
 * is charged: its cgroup (the state file's for it, else /proc/self/cgroup) must stay within the hard
 * limit that applies to it on that device, and the device within its total memory; otherwise
 * NVML_ERROR_MEMORY (20, the driver's out-of-memory; CUDA reports it as CUDA_ERROR_OUT_OF_MEMORY)
 * and nothing is recorded.  simnvmlFree(uuid, bytes) gives bytes back.  Neither needs nvmlInit (a
 * CUDA program does not call it).  Other returns: DRIVER_NOT_LOADED (no state), INVALID_ARGUMENT
 * (NULL uuid), NOT_FOUND (no such device), GPU_IS_LOST, UNKNOWN (the ledger cannot be written).
 */
static nvmlReturn_t do_allocate(const char *uuid, unsigned long long bytes, int give_back) {
    if (refresh_state() != 0) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (!uuid) return NVML_ERROR_INVALID_ARGUMENT;
    int fd = ledger_lock();
    if (fd < 0) return NVML_ERROR_UNKNOWN;
    struct sim_dev *d = dev_by_uuid(g_state, uuid);
    nvmlReturn_t ret = !d ? NVML_ERROR_NOT_FOUND : d->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
    if (ret != NVML_SUCCESS) {
        close(fd);
        return ret;
    }
    unsigned long long my_ns = caller_pidns();
    unsigned int me = (unsigned int)getpid();
    unsigned long long my_start = proc_start_ticks("/proc/self");
    const struct sim_proc *listed = NULL;
    for (size_t i = 0; i < d->nprocs && !listed; i++)
        if (visible_pid(&d->procs[i], my_ns) == me) listed = &d->procs[i];
    unsigned int host_pid = listed ? listed->host_pid : (g_state->host_ns == 0 || my_ns == g_state->host_ns) ? me : 0;
    if (!give_back) {
        char ns[CGROUP_PATH_MAX];
        const struct sim_limit *L = NULL;
        if (proc_namespace(listed && listed->cgroup ? listed : NULL, "self", ns, sizeof ns) == 0)
            L = limiting(d->uuid, ns);
        unsigned long long dev_used = device_used(d);
        if (bytes > d->total || dev_used > d->total - bytes) ret = NVML_ERROR_MEMORY;
        if (L) {
            unsigned long long used = group_used(d, L);
            if (bytes > L->hard || used > L->hard - bytes) ret = NVML_ERROR_MEMORY;
        }
        if (ret != NVML_SUCCESS) {
            close(fd);
            return ret;
        }
    }
    /* Drop the entries of exited processes, then add to (or take from) the caller's. */
    struct sim_alloc *mine = NULL;
    size_t k = 0;
    for (size_t i = 0; i < g_ledger.nallocs; i++) {
        if (!alloc_alive(&g_ledger.allocs[i])) continue;
        g_ledger.allocs[k] = g_ledger.allocs[i];
        const struct sim_alloc *a = &g_ledger.allocs[k];
        if (strcmp(a->uuid, d->uuid) == 0 && a->ns_inode == my_ns && a->ns_pid == me && a->start == my_start)
            mine = &g_ledger.allocs[k];
        k++;
    }
    g_ledger.nallocs = k;
    if (!mine && !give_back) {
        if (grow((void **)&g_ledger.allocs, &g_ledger.alloccap, g_ledger.nallocs, sizeof *mine)) {
            close(fd);
            return NVML_ERROR_UNKNOWN;
        }
        mine = &g_ledger.allocs[g_ledger.nallocs++];
        memset(mine, 0, sizeof *mine);
        snprintf(mine->uuid, sizeof mine->uuid, "%s", d->uuid);
        mine->ns_inode = my_ns;
        mine->ns_pid = me;
        mine->start = my_start;
    }
    if (mine) {
        mine->pid = host_pid;
        mine->bytes = give_back ? (bytes > mine->bytes ? 0 : mine->bytes - bytes) : mine->bytes + bytes;
        if (mine->bytes == 0) *mine = g_ledger.allocs[--g_ledger.nallocs];
    }
    return ledger_commit(fd, &g_ledger);
}

EXPORT nvmlReturn_t simnvmlAllocate(const char *uuid, unsigned long long bytes) { LOCKED(do_allocate(uuid, bytes, 0)); }
EXPORT nvmlReturn_t simnvmlFree(const char *uuid, unsigned long long bytes) { LOCKED(do_allocate(uuid, bytes, 1)); }
