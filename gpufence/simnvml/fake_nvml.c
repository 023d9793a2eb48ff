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
 * One translation unit in four files, which share the static state without a header: this one
 * (the ABI, the entry points' locking and failure injection, init, system and device queries)
 * includes fake_nvml_state.c (the state file), fake_nvml_processes.c (process lists and
 * utilisation) and, at the end, fake_nvml_limits.c (NVML R615's per-cgroup memory limits and the
 * simulated allocations that they limit).
 *
 * Build: cc -O2 -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c -lpthread
 * (simnvml.build_library() does this once per source hash; -DSIMNVML_NO_MEMORY_LIMITS builds the
 * "old driver", without the memory-limit entry points).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
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

#include "fake_nvml_state.c"

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

#include "fake_nvml_processes.c"

#include "fake_nvml_limits.c"
