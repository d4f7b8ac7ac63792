/* Preloaded (LD_PRELOAD) into a launch's server processes: mpirun, every tritonserver and its python stubs.
 * preload.py builds it and says why each part is needed; in short:
 * - tritonserver gets the arguments listed in $TRTGLM_SERVER_ARGS (one a line) after its own, so that the
 *   repository API's secret reaches it without being on any command line (/proc/PID/cmdline is world-readable,
 *   a process's environment is not);
 * - shared-memory segments are created readable by this user alone and stay so (Boost.Interprocess asks for
 *   0644 and then fchmods to it whatever the umask);
 * - with $TRTGLM_LOOPBACK_BINDS set, a process other than tritonserver (mpirun and its daemons, whose
 *   out-of-band listeners bind to every interface whatever the MCA settings) binds wildcard addresses to
 *   loopback instead. tritonserver binds where --host says and is left alone.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define ARGS_VAR "TRTGLM_SERVER_ARGS"
#define LOOPBACK_VAR "TRTGLM_LOOPBACK_BINDS"
#define SHM_DIR "/dev/shm/"
#define PRIVATE(mode) ((mode) & 0700)

typedef int (*main_fn)(int, char **, char **);
typedef int (*start_fn)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *);

static int loopback_binds;

static int is_tritonserver(const char *argv0) {
    const char *slash = strrchr(argv0, '/');
    return strcmp(slash ? slash + 1 : argv0, "tritonserver") == 0;
}

/* argv, then each line of `extra` (kept for the process's life, as argv is) */
static char **with_extra_args(int argc, char **argv, const char *extra, int *new_argc) {
    size_t lines = 1;
    for (const char *p = extra; *p; p++)
        lines += *p == '\n';
    char **args = calloc(argc + lines + 1, sizeof(char *));
    char *copy = strdup(extra);
    if (args == NULL || copy == NULL)
        abort();
    memcpy(args, argv, argc * sizeof(char *));
    int n = argc;
    char *save = NULL;
    for (char *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save))
        args[n++] = line;
    *new_argc = n;
    return args;
}

int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void),
                      void (*rtld_fini)(void), void *stack_end) {
    start_fn real_start = (start_fn)dlsym(RTLD_NEXT, "__libc_start_main");
    if (argc > 0 && is_tritonserver(argv[0])) {
        const char *extra = getenv(ARGS_VAR);
        if (extra != NULL && *extra)
            argv = with_extra_args(argc, argv, extra, &argc);
        unsetenv(ARGS_VAR); /* the stubs it starts need neither */
        unsetenv(LOOPBACK_VAR);
    } else {
        loopback_binds = getenv(LOOPBACK_VAR) != NULL;
    }
    return real_start(main, argc, argv, init, fini, rtld_fini, stack_end);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static int (*real_bind)(int, const struct sockaddr *, socklen_t);
    if (real_bind == NULL)
        real_bind = dlsym(RTLD_NEXT, "bind");
    if (loopback_binds && addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in local = *(const struct sockaddr_in *)addr;
        if (local.sin_addr.s_addr == htonl(INADDR_ANY)) {
            local.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&local, sizeof local);
        }
    }
    if (loopback_binds && addr != NULL && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 local = *(const struct sockaddr_in6 *)addr;
        if (IN6_IS_ADDR_UNSPECIFIED(&local.sin6_addr)) {
            local.sin6_addr = in6addr_loopback;
            return real_bind(fd, (const struct sockaddr *)&local, sizeof local);
        }
    }
    return real_bind(fd, addr, len);
}

int shm_open(const char *name, int oflag, mode_t mode) {
    static int (*real_shm_open)(const char *, int, mode_t);
    if (real_shm_open == NULL)
        real_shm_open = dlsym(RTLD_NEXT, "shm_open");
    return real_shm_open(name, oflag, PRIVATE(mode));
}

static int is_shm(int fd) {
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    return n > (ssize_t)strlen(SHM_DIR) && strncmp(path, SHM_DIR, strlen(SHM_DIR)) == 0;
}

int fchmod(int fd, mode_t mode) {
    static int (*real_fchmod)(int, mode_t);
    if (real_fchmod == NULL)
        real_fchmod = dlsym(RTLD_NEXT, "fchmod");
    return real_fchmod(fd, (mode & 077) && is_shm(fd) ? PRIVATE(mode) : mode);
}
