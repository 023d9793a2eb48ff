/*
 * simnvml, continued: the simulated state (devices, processes, injected failures), read from the
 * state file that simnvml.write_state() writes, and re-read when the file changes.  Included by
 * fake_nvml.c where this section stood (one translation unit: no header).
 */

/* ---- simulated state ------------------------------------------------------------------------ */

#define STATE_ENV "GPUFENCE_SIM_STATE"
#define STATE_MAGIC "gpufence-simnvml 1"
#define MAX_DEVICES 256
/* The simulated driver produces one utilisation sample per process per period. */
#define SAMPLE_PERIOD_US 10000ULL
#define DRIVER_VERSION "560.35.03"
#define NVML_VERSION "12.560.35.03"
#define CUDA_DRIVER_VERSION 12060
#define CGROUP_PATH_MAX 1024

struct sim_proc {
    unsigned int host_pid;
    unsigned long long used; /* NVML_VALUE_NOT_AVAILABLE_ULL when not available */
    unsigned int sm_util;
    int graphics; /* the list it is in: 0 compute, 1 graphics, 2 MPS compute (an MPS client) */
    int has_ns;
    unsigned long long ns_inode;
    unsigned int ns_pid;
    char *cgroup;               /* the state file's cgroup namespace for it (malloc'd), or NULL: /proc/<pid>/cgroup */
    unsigned long long charged; /* bytes it allocated through simnvmlAllocate (fake_nvml_limits.c) */
};

struct sim_dev {
    char uuid[96];
    char name[96];
    unsigned long long total;
    int lost;
    int meminfo_not_supported;
    int mig; /* MIG mode enabled (nvmlDeviceGetMigMode) */
    struct sim_proc *procs;
    size_t nprocs, cap;
};

struct sim_fail {
    char fn[128];
    int dev; /* -1: every device and device-less calls */
    nvmlReturn_t code;
    int hang; /* 1: the call blocks (a GPU off the bus) until the state file no longer says so */
};

struct sim_state {
    int legacy;
    unsigned long long util_lag_ms; /* 0: utilisation is the state file's; else see lagged_util() */
    unsigned long long host_ns;
    nvmlReturn_t init_error;
    struct sim_dev *devs;
    size_t ndevs, devcap;
    struct sim_fail *fails;
    size_t nfails, failcap;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
/* g_base: the state file as parsed; g_state: what the driver shows, g_base plus the allocations
 * that processes made through simnvmlAllocate (rebuilt by refresh_view in fake_nvml_limits.c). */
static struct sim_state *g_base;
static struct sim_state *g_state;
static struct {
    int valid;
    char path[4096];
    dev_t dev;
    ino_t ino;
    struct timespec mtim;
    off_t size;
} g_key;
static int g_init_count;
static struct nvmlDevice_st g_handles[MAX_DEVICES];
static pid_t g_ns_for_pid;
static unsigned long long g_caller_ns;

static void warn(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("simnvml: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void free_state(struct sim_state *s) {
    if (!s) return;
    for (size_t i = 0; i < s->ndevs; i++) {
        for (size_t j = 0; j < s->devs[i].nprocs; j++) free(s->devs[i].procs[j].cgroup);
        free(s->devs[i].procs);
    }
    free(s->devs);
    free(s->fails);
    free(s);
}

static int grow(void **p, size_t *cap, size_t n, size_t elem) {
    if (n < *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 8;
    void *q = realloc(*p, nc * elem);
    if (!q) return -1;
    memset((char *)q + *cap * elem, 0, (nc - *cap) * elem);
    *p = q;
    *cap = nc;
    return 0;
}

static int parse_ull(const char *tok, unsigned long long *out) {
    if (!tok || !*tok) return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(tok, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

static int parse_opt_ull(const char *tok, unsigned long long *out, int *present) {
    if (tok && strcmp(tok, "-") == 0) {
        *present = 0;
        *out = 0;
        return 0;
    }
    *present = 1;
    return parse_ull(tok, out);
}

/* Parses the state file; returns NULL (and warns) when it is malformed or incomplete. */
static struct sim_state *parse_state(FILE *f, const char *path) {
    struct sim_state *s = calloc(1, sizeof *s);
    char *line = NULL;
    size_t linecap = 0;
    ssize_t len;
    int lineno = 0, complete = 0;
    if (!s) return NULL;
    while ((len = getline(&line, &linecap, f)) >= 0) {
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (lineno == 1) {
            if (strcmp(line, STATE_MAGIC) != 0) goto bad;
            continue;
        }
        if (complete) goto bad; /* nothing after "end" */
        if (len == 0 || line[0] == '#') continue;
        char *save = NULL;
        char *kw = strtok_r(line, " ", &save);
        unsigned long long v;
        if (strcmp(kw, "end") == 0) {
            complete = 1;
        } else if (strcmp(kw, "driver") == 0) {
            char *mode = strtok_r(NULL, " ", &save);
            if (!mode) goto bad;
            if (strcmp(mode, "legacy") == 0) s->legacy = 1;
            else if (strcmp(mode, "namespace_aware") == 0) s->legacy = 0;
            else goto bad;
        } else if (strcmp(kw, "util_lag_ms") == 0) {
            if (parse_ull(strtok_r(NULL, " ", &save), &s->util_lag_ms)) goto bad;
        } else if (strcmp(kw, "host_pidns") == 0) {
            if (parse_ull(strtok_r(NULL, " ", &save), &s->host_ns)) goto bad;
        } else if (strcmp(kw, "init_error") == 0) {
            if (parse_ull(strtok_r(NULL, " ", &save), &v)) goto bad;
            s->init_error = (nvmlReturn_t)v;
        } else if (strcmp(kw, "fail") == 0 || strcmp(kw, "hang") == 0) {
            int hang = strcmp(kw, "hang") == 0;
            char *fn = strtok_r(NULL, " ", &save);
            if (!fn || strlen(fn) >= sizeof s->fails[0].fn) goto bad;
            v = 0;
            if (!hang && parse_ull(strtok_r(NULL, " ", &save), &v)) goto bad;
            if (grow((void **)&s->fails, &s->failcap, s->nfails, sizeof *s->fails)) goto bad;
            struct sim_fail *fl = &s->fails[s->nfails++];
            fl->code = (nvmlReturn_t)v;
            fl->hang = hang;
            fl->dev = -1;
            char *at = strchr(fn, '@');
            if (at) {
                unsigned long long d;
                *at = 0;
                if (parse_ull(at + 1, &d) || d >= MAX_DEVICES) goto bad;
                fl->dev = (int)d;
            }
            strcpy(fl->fn, fn);
        } else if (strcmp(kw, "device") == 0) {
            /* device TOTAL LOST MEMINFO_NOT_SUPPORTED UUID NAME... */
            unsigned long long total, lost, mns;
            if (parse_ull(strtok_r(NULL, " ", &save), &total)) goto bad;
            if (parse_ull(strtok_r(NULL, " ", &save), &lost)) goto bad;
            if (parse_ull(strtok_r(NULL, " ", &save), &mns)) goto bad;
            char *uuid = strtok_r(NULL, " ", &save);
            char *name = strtok_r(NULL, "", &save);
            if (!uuid || strlen(uuid) >= sizeof s->devs[0].uuid) goto bad;
            if (!name) name = "";
            if (strlen(name) >= sizeof s->devs[0].name) goto bad;
            if (s->ndevs >= MAX_DEVICES) goto bad;
            if (grow((void **)&s->devs, &s->devcap, s->ndevs, sizeof *s->devs)) goto bad;
            struct sim_dev *d = &s->devs[s->ndevs++];
            d->total = total;
            d->lost = lost != 0;
            d->meminfo_not_supported = mns != 0;
            strcpy(d->uuid, uuid);
            strcpy(d->name, name);
        } else if (strcmp(kw, "mig") == 0) {
            /* mig   (MIG mode enabled on the last device) */
            if (s->ndevs == 0) goto bad;
            s->devs[s->ndevs - 1].mig = 1;
        } else if (strcmp(kw, "proc") == 0) {
            /* proc KIND PID USED|- SM NS_INODE|- NS_PID|- [CGROUP]   (belongs to the last device) */
            if (s->ndevs == 0) goto bad;
            struct sim_dev *d = &s->devs[s->ndevs - 1];
            char *kind = strtok_r(NULL, " ", &save);
            unsigned long long pid, sm, nsino, nspid;
            int has_used, has_ino, has_nspid;
            if (!kind || (strcmp(kind, "compute") && strcmp(kind, "graphics") && strcmp(kind, "mps"))) goto bad;
            if (parse_ull(strtok_r(NULL, " ", &save), &pid) || pid > 0xFFFFFFFFULL) goto bad;
            if (parse_opt_ull(strtok_r(NULL, " ", &save), &v, &has_used)) goto bad;
            if (parse_ull(strtok_r(NULL, " ", &save), &sm)) goto bad;
            if (parse_opt_ull(strtok_r(NULL, " ", &save), &nsino, &has_ino)) goto bad;
            if (parse_opt_ull(strtok_r(NULL, " ", &save), &nspid, &has_nspid)) goto bad;
            if (has_ino != has_nspid || nspid > 0xFFFFFFFFULL) goto bad;
            if (grow((void **)&d->procs, &d->cap, d->nprocs, sizeof *d->procs)) goto bad;
            struct sim_proc *p = &d->procs[d->nprocs++];
            p->graphics = strcmp(kind, "graphics") == 0 ? 1 : strcmp(kind, "mps") == 0 ? 2 : 0;
            p->host_pid = (unsigned int)pid;
            p->used = has_used ? v : NVML_VALUE_NOT_AVAILABLE_ULL;
            p->sm_util = (unsigned int)sm;
            p->has_ns = has_ino;
            p->ns_inode = nsino;
            p->ns_pid = (unsigned int)nspid;
            char *cgroup = strtok_r(NULL, " ", &save);
            if (cgroup) {
                if (cgroup[0] != '/' || strlen(cgroup) >= CGROUP_PATH_MAX || strtok_r(NULL, " ", &save)) goto bad;
                if (!(p->cgroup = strdup(cgroup))) goto bad;
            }
        } else {
            goto bad;
        }
    }
    if (!complete) {
        warn("state file %s is incomplete (no 'end' line)", path);
        goto fail;
    }
    free(line);
    return s;
bad:
    warn("state file %s: malformed line %d", path, lineno);
fail:
    free(line);
    free_state(s);
    return NULL;
}

/*
 * Re-reads the state file if $GPUFENCE_SIM_STATE names a different or changed file.  Keeps the
 * last good state when the file is missing or malformed.  Returns 0 when a state is available.
 * Caller holds g_lock.
 */
static int refresh_view(const char *state_path, int base_changed, int force);

static int refresh_base(const char *path);

static int refresh_state(void) {
    const char *path = getenv(STATE_ENV);
    if (!path || !*path) return g_state ? 0 : -1;
    int changed = refresh_base(path);
    if (!g_base) return -1;
    return refresh_view(path, changed, 0);
}

/* Returns 1 when g_base was (re)loaded, 0 when it is unchanged or the file is unusable. */
static int refresh_base(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) return 0;
    if (g_key.valid && strcmp(g_key.path, path) == 0 && g_key.dev == st.st_dev && g_key.ino == st.st_ino &&
        g_key.mtim.tv_sec == st.st_mtim.tv_sec && g_key.mtim.tv_nsec == st.st_mtim.tv_nsec &&
        g_key.size == st.st_size)
        return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    /* Key on the opened file, so a replace between stat() and fopen() is picked up next call. */
    if (fstat(fileno(f), &st) != 0) {
        fclose(f);
        return 0;
    }
    struct sim_state *s = parse_state(f, path);
    fclose(f);
    g_key.valid = 1;
    snprintf(g_key.path, sizeof g_key.path, "%s", path);
    g_key.dev = st.st_dev;
    g_key.ino = st.st_ino;
    g_key.mtim = st.st_mtim;
    g_key.size = st.st_size;
    if (!s) return 0; /* malformed: keep the last good state, warn once */
    free_state(g_base);
    g_base = s;
    return 1;
}
