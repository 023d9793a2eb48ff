/*
 * simnvml: a fake libnvidia-ml.so.1 for gpufence's tests, demo and `gpufence-enforcer --simulate`.
 *
 * It implements, with the real NVML ABI (struct layouts, return codes, symbol names and the
 * buffer-sizing protocol), the entry points the enforcer uses through the real pynvml.  The
 * simulated devices and processes come from a state file named by $GPUFENCE_SIM_STATE, written
 * by simnvml.write_state() (Python).  The file format is private to that writer; see
 * gpufence/simnvml/__init__.py.  The environment variable is read at every call and the file is re-read
 * only when it changed (device, inode, mtime, size), so a test can rewrite the state between
 * two NVML calls.  All entry points are serialised by one mutex.
 *
 * NVML R615's per-cgroup memory limits and the simulated allocations that they limit are in
 * fake_nvml_limits.c, included at the end of this file (one translation unit, so the two share the
 * static state without a header).
 *
 * Build: cc -O2 -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c -lpthread
 * (simnvml.build_library() does this once per source hash; -DSIMNVML_NO_MEMORY_LIMITS builds the
 * "old driver", without the memory-limit entry points).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- NVML ABI (values and layouts as in nvml.h / pynvml) ---------------------------------- */

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_ALREADY_INITIALIZED 5
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_MEMORY 20
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFU

typedef struct nvmlDevice_st {
    unsigned int index;
} *nvmlDevice_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_STRUCT_VERSION(size, ver) ((unsigned int)(size) | ((unsigned int)(ver) << 24U))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(sizeof(nvmlMemory_v2_t), 2)

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* v2 and v3 share this layout (pynvml: c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v2_t). */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(nvmlMemory_v2 == 0x02000028U, "nvmlMemory_v2 version");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvmlProcessInfo_v2_t layout");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t layout");

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

/* The first failure (hang: hang entries, else fail entries) matching the call, or NULL. */
static const struct sim_fail *matching(const char *fn, int dev, int hang) {
    size_t baselen = strlen(fn);
    /* "nvmlFoo_v3" is also matched by a failure named "nvmlFoo". */
    const char *v = strrchr(fn, '_');
    if (v && v[1] == 'v' && v[2] >= '0' && v[2] <= '9') baselen = (size_t)(v - fn);
    int is_init = strncmp(fn, "nvmlInit", 8) == 0;
    for (size_t i = 0; i < g_state->nfails; i++) {
        const struct sim_fail *f = &g_state->fails[i];
        if (f->hang != hang || (f->dev >= 0 && f->dev != dev)) continue;
        if ((strcmp(f->fn, "*") == 0 && !is_init) || strcmp(f->fn, fn) == 0 ||
            (strlen(f->fn) == baselen && strncmp(f->fn, fn, baselen) == 0))
            return f;
    }
    return NULL;
}

static nvmlReturn_t injected(const char *fn, int dev) {
    const struct sim_fail *f = matching(fn, dev, 0);
    return f ? f->code : NVML_SUCCESS;
}

/* Common prologue for calls after init: lock held by caller. A "hang" entry blocks the call, as a
 * GPU that fell off the bus does, until a new state file drops it; the lock is released while
 * waiting so the test (and other callers) can go on. */
static nvmlReturn_t enter(const char *fn, int dev) {
    for (;;) {
        if (refresh_state() != 0 || g_init_count == 0) return NVML_ERROR_UNINITIALIZED;
        if (!matching(fn, dev, 1)) break;
        pthread_mutex_unlock(&g_lock);
        usleep(10000);
        pthread_mutex_lock(&g_lock);
    }
    return injected(fn, dev);
}

/* Resolves a handle to the current device; dev_out gets the index. */
static nvmlReturn_t enter_device(const char *fn, nvmlDevice_t device, struct sim_dev **dev_out) {
    if (device < g_handles || device >= g_handles + MAX_DEVICES) {
        nvmlReturn_t ret = enter(fn, -1);
        return ret != NVML_SUCCESS ? ret : NVML_ERROR_INVALID_ARGUMENT;
    }
    unsigned int index = (unsigned int)(device - g_handles);
    nvmlReturn_t ret = enter(fn, (int)index);
    if (ret != NVML_SUCCESS) return ret;
    /* A device that left the state file behaves like one that fell off the bus. */
    if (index >= g_state->ndevs || g_state->devs[index].lost) return NVML_ERROR_GPU_IS_LOST;
    *dev_out = &g_state->devs[index];
    return NVML_SUCCESS;
}

#define LOCKED(expr)                          \
    do {                                      \
        pthread_mutex_lock(&g_lock);          \
        nvmlReturn_t ret_ = (expr);           \
        pthread_mutex_unlock(&g_lock);        \
        return ret_;                          \
    } while (0)

static nvmlReturn_t copy_string(const char *src, char *dst, unsigned int length) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* The caller's innermost PID namespace inode (0 if unknown), re-read after a fork. */
static unsigned long long caller_pidns(void) {
    pid_t me = getpid();
    if (me != g_ns_for_pid) {
        char buf[64];
        ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
        unsigned long long ino = 0;
        if (n > 0) {
            buf[n] = 0;
            if (sscanf(buf, "pid:[%llu]", &ino) != 1) ino = 0;
        }
        g_caller_ns = ino;
        g_ns_for_pid = me;
    }
    return g_caller_ns;
}

/* A later entry (another list) of a pid listed before: NVML samples a process once. */
static int duplicate_sample(const struct sim_dev *d, size_t i) {
    for (size_t j = 0; j < i; j++)
        if (d->procs[j].host_pid == d->procs[i].host_pid) return 1;
    return 0;
}

/* The PID the driver reports for p to this caller; 0 when the caller must not see it. */
static unsigned int visible_pid(const struct sim_proc *p, unsigned long long caller_ns) {
    if (g_state->legacy || caller_ns == 0 || caller_ns == g_state->host_ns) return p->host_pid;
    if (p->has_ns && p->ns_inode == caller_ns) return p->ns_pid;
    return 0;
}

/* ---- init / system ------------------------------------------------------------------------- */

static nvmlReturn_t do_init(const char *fn) {
    if (refresh_state() != 0) {
        const char *path = getenv(STATE_ENV);
        if (!path || !*path)
            warn("%s is not set: no simulated driver state, reporting DRIVER_NOT_LOADED", STATE_ENV);
        else
            warn("cannot load simulated driver state from %s (%s=%s), reporting DRIVER_NOT_LOADED", path,
                 STATE_ENV, path);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    if (g_state->init_error != NVML_SUCCESS) return g_state->init_error;
    nvmlReturn_t ret = injected(fn, -1);
    if (ret != NVML_SUCCESS) return ret;
    g_init_count++;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { LOCKED(do_init("nvmlInit_v2")); }
EXPORT nvmlReturn_t nvmlInit(void) { LOCKED(do_init("nvmlInit")); }
EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    LOCKED(do_init("nvmlInitWithFlags"));
}

static nvmlReturn_t do_shutdown(void) {
    if (g_init_count == 0) return NVML_ERROR_UNINITIALIZED;
    g_init_count--;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlShutdown(void) { LOCKED(do_shutdown()); }

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Ran out of critical resources, other than memory";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not Ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 30: return "Reset type not supported";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t do_sys_string(const char *fn, const char *value, char *buf, unsigned int length) {
    nvmlReturn_t ret = enter(fn, -1);
    return ret != NVML_SUCCESS ? ret : copy_string(value, buf, length);
}
EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    LOCKED(do_sys_string("nvmlSystemGetDriverVersion", DRIVER_VERSION, version, length));
}
EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    /* Real NVML answers this one without nvmlInit. */
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t ret = copy_string(NVML_VERSION, version, length);
    pthread_mutex_unlock(&g_lock);
    return ret;
}

static nvmlReturn_t do_cuda_version(const char *fn, int *v) {
    nvmlReturn_t ret = enter(fn, -1);
    if (ret != NVML_SUCCESS) return ret;
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    *v = CUDA_DRIVER_VERSION;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { LOCKED(do_cuda_version("nvmlSystemGetCudaDriverVersion", v)); }
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) {
    LOCKED(do_cuda_version("nvmlSystemGetCudaDriverVersion_v2", v));
}

/* ---- devices ------------------------------------------------------------------------------ */

static nvmlReturn_t do_count(const char *fn, unsigned int *count) {
    nvmlReturn_t ret = enter(fn, -1);
    if (ret != NVML_SUCCESS) return ret;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)g_state->ndevs;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { LOCKED(do_count("nvmlDeviceGetCount_v2", count)); }
EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { LOCKED(do_count("nvmlDeviceGetCount", count)); }

static nvmlReturn_t do_handle_by_index(const char *fn, unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t ret = enter(fn, (int)(index < MAX_DEVICES ? index : MAX_DEVICES));
    if (ret != NVML_SUCCESS) return ret;
    if (!device || index >= g_state->ndevs) return NVML_ERROR_INVALID_ARGUMENT;
    if (g_state->devs[index].lost) return NVML_ERROR_GPU_IS_LOST;
    g_handles[index].index = index;
    *device = &g_handles[index];
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    LOCKED(do_handle_by_index("nvmlDeviceGetHandleByIndex_v2", index, device));
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    LOCKED(do_handle_by_index("nvmlDeviceGetHandleByIndex", index, device));
}

static nvmlReturn_t do_handle_by_uuid(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t ret = enter("nvmlDeviceGetHandleByUUID", -1);
    if (ret != NVML_SUCCESS) return ret;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (size_t i = 0; i < g_state->ndevs; i++) {
        if (strcmp(g_state->devs[i].uuid, uuid) == 0) {
            if (g_state->devs[i].lost) return NVML_ERROR_GPU_IS_LOST;
            g_handles[i].index = (unsigned int)i;
            *device = &g_handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}
EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    LOCKED(do_handle_by_uuid(uuid, device));
}

static nvmlReturn_t do_index(nvmlDevice_t device, unsigned int *index) {
    struct sim_dev *d;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetIndex", device, &d);
    if (ret != NVML_SUCCESS) return ret;
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)(d - g_state->devs);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) { LOCKED(do_index(device, index)); }

static nvmlReturn_t do_dev_string(const char *fn, nvmlDevice_t device, int want_uuid, char *buf, unsigned int length) {
    struct sim_dev *d;
    nvmlReturn_t ret = enter_device(fn, device, &d);
    if (ret != NVML_SUCCESS) return ret;
    return copy_string(want_uuid ? d->uuid : d->name, buf, length);
}
static nvmlReturn_t do_mig_mode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    struct sim_dev *d;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetMigMode", device, &d);
    if (ret != NVML_SUCCESS) return ret;
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = (unsigned int)d->mig;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    LOCKED(do_mig_mode(device, currentMode, pendingMode));
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    LOCKED(do_dev_string("nvmlDeviceGetUUID", device, 1, uuid, length));
}
EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    LOCKED(do_dev_string("nvmlDeviceGetName", device, 0, name, length));
}

/* The bytes a process holds on its device: the state file's figure plus its simulated allocations
 * (only the allocations when the state file says "not available"). */
static unsigned long long proc_bytes(const struct sim_proc *p) {
    return p->used == NVML_VALUE_NOT_AVAILABLE_ULL ? p->charged : p->used;
}

static unsigned long long device_used(const struct sim_dev *d) {
    unsigned long long u = 0;
    for (size_t i = 0; i < d->nprocs; i++) u += proc_bytes(&d->procs[i]);
    return u;
}

static void memory_of(const struct sim_dev *d, unsigned long long *total, unsigned long long *used,
                      unsigned long long *free_) {
    unsigned long long u = device_used(d);
    if (u > d->total) u = d->total;
    *total = d->total;
    *used = u;
    *free_ = d->total - u;
}

static nvmlReturn_t do_memory(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct sim_dev *d;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetMemoryInfo", device, &d);
    if (ret != NVML_SUCCESS) return ret;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->meminfo_not_supported) return NVML_ERROR_NOT_SUPPORTED;
    memory_of(d, &memory->total, &memory->used, &memory->free);
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    LOCKED(do_memory(device, memory));
}

static nvmlReturn_t do_memory_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    struct sim_dev *d;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetMemoryInfo_v2", device, &d);
    if (ret != NVML_SUCCESS) return ret;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (d->meminfo_not_supported) return NVML_ERROR_NOT_SUPPORTED;
    memory_of(d, &memory->total, &memory->used, &memory->free);
    memory->reserved = 0;
    return NVML_SUCCESS;
}
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    LOCKED(do_memory_v2(device, memory));
}

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

#include "fake_nvml_limits.c"
