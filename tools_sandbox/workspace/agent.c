/* The workspace agent: the first process of every workspace (a Docker container or a bubblewrap root).
 *
 * Built once on the host as a static binary (tools_sandbox/workspace/agent_build.py), so it runs in any Linux
 * image, with or without a libc or a shell of its own. It reads requests on stdin and answers on stdout, in
 * length-prefixed binary frames (protocol.py is the other side):
 *
 *   frame    = u32 length (of what follows, little-endian) | u32 id | u8 op-or-kind | field*
 *   field    = u8 tag | u32 length | bytes          (integers: 8 bytes, little-endian, signed)
 *
 * Requests: EXEC (fork/exec argv with env overrides, cwd, stdin, uid/gid, a timeout and an output limit; many
 * at once), READ / WRITE / LIST (files), KILLALL (every process but this one and pid 1), CANCEL (kill one
 * EXEC's process group). Each EXEC's child leads its own session, so a timeout, an output flood or a cancel
 * kills its whole process group — and so does the command's end, unless it asked to DETACH (background
 * processes it started then keep running). As pid 1 the agent reaps every orphan. When stdin closes (its owner is gone)
 * it kills everything and exits, so the workspace stops with it.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { OP_EXEC = 1, OP_READ = 2, OP_WRITE = 3, OP_LIST = 4, OP_KILLALL = 5, OP_CANCEL = 6, OP_PING = 7 };
enum { K_EXEC_DONE = 1, K_OK = 2, K_DATA = 3, K_ERRNO = 4, K_LIST = 5, K_READY = 6 };
enum {
    T_ARG = 1, T_ENV = 2, T_CWD = 3, T_STDIN = 4, T_TIMEOUT_MS = 5, T_OUTPUT_LIMIT = 6, T_UID = 7, T_GID = 8,
    T_PATH = 9, T_DATA = 10, T_MODE = 11, T_PARENTS = 12, T_MAX_BYTES = 13, T_TARGET = 14, T_DETACH = 15,
    T_EXIT = 20, T_TIMED_OUT = 21, T_OUTPUT_EXCEEDED = 22, T_DURATION_US = 23, T_STDOUT = 24, T_STDERR = 25,
    T_SPAWN_ERROR = 26, T_ERRNO = 27, T_ENTRY = 28, T_KILLED = 29
};

#define MAX_CHILDREN 1024
#define DRAIN_MS 100 /* after a command exits, how long its pipes may stay open (background children) */

typedef struct { char *data; size_t len, cap; } buf_t;

typedef struct {
    int used;
    uint32_t id;
    pid_t pid;
    int out_fd, err_fd, in_fd;
    buf_t out, err, in;
    size_t in_off;
    int64_t deadline_ms, exit_ms, start_ms;
    int64_t output_limit;
    int exited, status, timed_out, output_exceeded, detach;
} child_t;

static child_t children[MAX_CHILDREN];
static int sig_pipe[2];
static buf_t inbuf;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void buf_put(buf_t *b, const void *p, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d) { perror("agent: out of memory"); _exit(70); }
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

static void buf_free(buf_t *b) { free(b->data); b->data = NULL; b->len = b->cap = 0; }

static void put_u32(buf_t *b, uint32_t v) {
    unsigned char c[4] = {v & 255, (v >> 8) & 255, (v >> 16) & 255, (v >> 24) & 255};
    buf_put(b, c, 4);
}

static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static int64_t get_i64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return (int64_t)v;
}

static void field(buf_t *b, uint8_t tag, const void *p, size_t n) {
    buf_put(b, &tag, 1);
    put_u32(b, (uint32_t)n);
    buf_put(b, p, n);
}

static void field_i64(buf_t *b, uint8_t tag, int64_t v) {
    unsigned char c[8];
    for (int i = 0; i < 8; i++) c[i] = ((uint64_t)v >> (8 * i)) & 255;
    field(b, tag, c, 8);
}

static void write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            _exit(0); /* our owner is gone */
        }
        p += w;
        n -= (size_t)w;
    }
}

/* A response: kind and id, then the fields already in `body`. */
static void respond(uint32_t id, uint8_t kind, buf_t *body) {
    buf_t f = {0};
    put_u32(&f, (uint32_t)(4 + 1 + (body ? body->len : 0)));
    put_u32(&f, id);
    buf_put(&f, &kind, 1);
    if (body && body->len) buf_put(&f, body->data, body->len);
    write_all(1, f.data, f.len);
    buf_free(&f);
}

static void respond_errno(uint32_t id, int err) {
    buf_t b = {0};
    field_i64(&b, T_ERRNO, err);
    respond(id, K_ERRNO, &b);
    buf_free(&b);
}

/* Parsed request fields (pointers into the frame). */
typedef struct {
    const char *args[4096];
    size_t nargs;
    const char *envs[4096];
    size_t nenvs;
    const char *cwd, *path;
    const unsigned char *stdin_p, *data_p;
    size_t stdin_n, data_n;
    int64_t timeout_ms, output_limit, uid, gid, mode, parents, max_bytes, target, detach;
} req_t;

/* String fields are copied out of the frame with a terminating NUL. */
static char *dupn(const unsigned char *p, size_t n) {
    char *s = malloc(n + 1);
    if (!s) _exit(70);
    memcpy(s, p, n);
    s[n] = 0;
    return s;
}

static int parse(const unsigned char *p, size_t n, req_t *r) {
    memset(r, 0, sizeof(*r));
    r->uid = r->gid = -1;
    r->timeout_ms = 60000;
    r->output_limit = 1 << 20;
    r->mode = 0644;
    r->max_bytes = 64 << 20;
    size_t off = 0;
    while (off < n) {
        if (n - off < 5) return -1;
        uint8_t tag = p[off];
        uint32_t len = get_u32(p + off + 1);
        off += 5;
        if (len > n - off) return -1;
        const unsigned char *v = p + off;
        int64_t iv = len == 8 ? get_i64(v) : 0;
        switch (tag) {
        case T_ARG: if (r->nargs < 4095) r->args[r->nargs++] = dupn(v, len); break;
        case T_ENV: if (r->nenvs < 4095) r->envs[r->nenvs++] = dupn(v, len); break;
        case T_CWD: r->cwd = dupn(v, len); break;
        case T_PATH: r->path = dupn(v, len); break;
        case T_STDIN: r->stdin_p = v; r->stdin_n = len; break;
        case T_DATA: r->data_p = v; r->data_n = len; break;
        case T_TIMEOUT_MS: r->timeout_ms = iv; break;
        case T_OUTPUT_LIMIT: r->output_limit = iv; break;
        case T_UID: r->uid = iv; break;
        case T_GID: r->gid = iv; break;
        case T_MODE: r->mode = iv; break;
        case T_PARENTS: r->parents = iv; break;
        case T_MAX_BYTES: r->max_bytes = iv; break;
        case T_TARGET: r->target = iv; break;
        case T_DETACH: r->detach = iv; break;
        default: break;
        }
        off += len;
    }
    return 0;
}

static void free_req(req_t *r) {
    for (size_t i = 0; i < r->nargs; i++) free((void *)r->args[i]);
    for (size_t i = 0; i < r->nenvs; i++) free((void *)r->envs[i]);
    free((void *)r->cwd);
    free((void *)r->path);
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

extern char **environ;

/* In the child: the environment = ours, with the request's NAME=value entries replacing or adding. */
static char **child_env(req_t *r) {
    size_t n = 0;
    while (environ[n]) n++;
    char **env = calloc(n + r->nenvs + 1, sizeof(char *));
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const char *eq = strchr(environ[i], '=');
        size_t klen = eq ? (size_t)(eq - environ[i]) : strlen(environ[i]);
        int replaced = 0;
        for (size_t j = 0; j < r->nenvs; j++)
            if (strncmp(r->envs[j], environ[i], klen) == 0 && r->envs[j][klen] == '=') replaced = 1;
        if (!replaced) env[k++] = environ[i];
    }
    for (size_t j = 0; j < r->nenvs; j++) env[k++] = (char *)r->envs[j];
    env[k] = NULL;
    return env;
}

static void exec_path(const char *file, char **argv, char **env) {
    if (strchr(file, '/')) {
        execve(file, argv, env);
        return;
    }
    const char *path = NULL;
    for (char **e = env; *e; e++)
        if (strncmp(*e, "PATH=", 5) == 0) path = *e + 5;
    if (!path) path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
    int err = ENOENT;
    while (*path) {
        const char *colon = strchr(path, ':');
        size_t len = colon ? (size_t)(colon - path) : strlen(path);
        char full[4096];
        if (len + strlen(file) + 2 < sizeof(full)) {
            memcpy(full, path, len);
            full[len] = '/';
            strcpy(full + len + 1, file);
            execve(full, argv, env);
            if (errno != ENOENT && errno != ENOTDIR) err = errno;
        }
        if (!colon) break;
        path = colon + 1;
    }
    errno = err;
}

static child_t *free_slot(void) {
    for (int i = 0; i < MAX_CHILDREN; i++)
        if (!children[i].used) return &children[i];
    return NULL;
}

static void do_exec(uint32_t id, req_t *r) {
    buf_t b = {0};
    child_t *c = free_slot();
    if (!c || r->nargs == 0) {
        field(&b, T_SPAWN_ERROR, c ? "empty argv" : "too many commands at once", c ? 10 : 24);
        respond(id, K_EXEC_DONE, &b);
        buf_free(&b);
        return;
    }
    int in_p[2], out_p[2], err_p[2], fail_p[2];
    if (pipe2(in_p, O_CLOEXEC) || pipe2(out_p, O_CLOEXEC) || pipe2(err_p, O_CLOEXEC) || pipe2(fail_p, O_CLOEXEC)) {
        respond_errno(id, errno);
        return;
    }
    int64_t t0 = now_us();
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGCHLD, SIG_DFL);
        setsid();
        dup2(in_p[0], 0);
        dup2(out_p[1], 1);
        dup2(err_p[1], 2);
        struct rlimit core = {0, 0};
        setrlimit(RLIMIT_CORE, &core);
        /* Under memory pressure the kernel's OOM killer takes a command, never the agent (raising is allowed). */
        int adj = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (adj >= 0) { if (write(adj, "1000", 4) < 0) { /* not fatal */ } close(adj); }
        const char *stage = "cwd";
        if (r->cwd && chdir(r->cwd) != 0) goto fail;
        stage = "user";
        if (r->gid >= 0) {
            gid_t g = (gid_t)r->gid;
            if (setgroups(1, &g) != 0 || setgid(g) != 0) goto fail;
        }
        if (r->uid >= 0 && setuid((uid_t)r->uid) != 0) goto fail;
        umask(022);
        stage = "exec";
        char *argv[4097];
        for (size_t i = 0; i < r->nargs; i++) argv[i] = (char *)r->args[i];
        argv[r->nargs] = NULL;
        exec_path(argv[0], argv, child_env(r));
    fail:;
        char msg[600];
        int err = errno;
        int n = snprintf(msg, sizeof(msg), "%s: %s: %s", stage,
                         stage[0] == 'c' ? r->cwd : stage[0] == 'u' ? "setuid/setgid" : r->args[0], strerror(err));
        if (write(fail_p[1], msg, (size_t)n) < 0) _exit(126);
        _exit(127);
    }
    close(in_p[0]);
    close(out_p[1]);
    close(err_p[1]);
    close(fail_p[1]);
    if (pid < 0) {
        int err = errno;
        close(in_p[1]); close(out_p[0]); close(err_p[0]); close(fail_p[0]);
        respond_errno(id, err);
        return;
    }
    char msg[600];
    ssize_t n;
    do n = read(fail_p[0], msg, sizeof(msg) - 1); while (n < 0 && errno == EINTR);
    close(fail_p[0]);
    if (n > 0) { /* the child failed before exec: report why; the pid is reaped by the SIGCHLD loop */
        close(in_p[1]); close(out_p[0]); close(err_p[0]);
        field(&b, T_SPAWN_ERROR, msg, (size_t)n);
        respond(id, K_EXEC_DONE, &b);
        buf_free(&b);
        return;
    }
    memset(c, 0, sizeof(*c));
    c->used = 1;
    c->id = id;
    c->pid = pid;
    c->out_fd = out_p[0];
    c->err_fd = err_p[0];
    c->in_fd = in_p[1];
    set_nonblock(c->out_fd);
    set_nonblock(c->err_fd);
    set_nonblock(c->in_fd);
    if (r->stdin_n) buf_put(&c->in, r->stdin_p, r->stdin_n);
    else { close(c->in_fd); c->in_fd = -1; }
    c->start_ms = t0 / 1000;
    c->deadline_ms = now_ms() + (r->timeout_ms > 0 ? r->timeout_ms : 60000);
    c->output_limit = r->output_limit > 0 ? r->output_limit : (1 << 20);
    c->exit_ms = -1;
    c->detach = (int)r->detach;
}

static void kill_group(child_t *c) {
    if (!c->exited) {
        kill(-c->pid, SIGKILL);
        kill(c->pid, SIGKILL);
    }
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static void reap(void);

/* SIGKILL a process group until it is gone: members in the middle of a fork when one signal lands (a fork bomb)
 * would otherwise survive it. */
static void kill_group_fully(pid_t pgid) {
    for (int round = 0; round < 200; round++) {
        if (kill(-pgid, SIGKILL) != 0 && errno == ESRCH) return;
        reap();
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

static void finish(child_t *c) {
    /* What the command left running in its process group ends with it, unless it asked to stay (detach). */
    if (!c->detach) kill_group_fully(c->pid);
    buf_t b = {0};
    int64_t code = WIFEXITED(c->status) ? WEXITSTATUS(c->status) : WIFSIGNALED(c->status) ? -WTERMSIG(c->status) : -1;
    field_i64(&b, T_EXIT, code);
    field_i64(&b, T_TIMED_OUT, c->timed_out);
    field_i64(&b, T_OUTPUT_EXCEEDED, c->output_exceeded);
    field_i64(&b, T_DURATION_US, (c->exit_ms - c->start_ms) * 1000);
    field(&b, T_STDOUT, c->out.data ? c->out.data : "", c->out.len);
    field(&b, T_STDERR, c->err.data ? c->err.data : "", c->err.len);
    respond(c->id, K_EXEC_DONE, &b);
    buf_free(&b);
    close_fd(&c->out_fd);
    close_fd(&c->err_fd);
    close_fd(&c->in_fd);
    buf_free(&c->out);
    buf_free(&c->err);
    buf_free(&c->in);
    c->used = 0;
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_CHILDREN; i++) {
            child_t *c = &children[i];
            if (c->used && c->pid == pid && !c->exited) {
                c->exited = 1;
                c->status = status;
                c->exit_ms = now_ms();
            }
        }
    }
}

static void read_output(child_t *c, int *fd, buf_t *b) {
    char chunk[65536];
    for (;;) {
        ssize_t n = read(*fd, chunk, sizeof(chunk));
        if (n > 0) {
            size_t room = (size_t)c->output_limit > c->out.len + c->err.len
                              ? (size_t)c->output_limit - c->out.len - c->err.len : 0;
            if ((size_t)n > room) {
                buf_put(b, chunk, room);
                c->output_exceeded = 1;
                kill_group(c);
                close_fd(&c->out_fd);
                close_fd(&c->err_fd);
                return;
            }
            buf_put(b, chunk, (size_t)n);
            continue;
        }
        if (n == 0) close_fd(fd);
        else if (errno == EINTR) continue;
        else if (errno != EAGAIN) close_fd(fd);
        return;
    }
}

static void write_stdin(child_t *c) {
    while (c->in_off < c->in.len) {
        ssize_t n = write(c->in_fd, c->in.data + c->in_off, c->in.len - c->in_off);
        if (n > 0) { c->in_off += (size_t)n; continue; }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return;
        break; /* EPIPE: the command does not read its stdin */
    }
    close_fd(&c->in_fd);
}

static int mkdirs(const char *path) { /* mkdir -p of path's parent */
    char tmp[4096];
    if (strlen(path) >= sizeof(tmp)) return ENAMETOOLONG;
    strcpy(tmp, path);
    char *slash = strrchr(tmp, '/');
    if (!slash || slash == tmp) return 0;
    *slash = 0;
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return errno;
        *p = '/';
    }
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return errno;
    return 0;
}

static void do_read(uint32_t id, req_t *r) {
    /* O_NONBLOCK: opening a named pipe waits for a writer otherwise, and this loop is the workspace's only one */
    int fd = open(r->path ? r->path : "", O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) { respond_errno(id, errno); return; }
    struct stat st;
    if (fstat(fd, &st) != 0) { int e = errno; close(fd); respond_errno(id, e); return; }
    if (S_ISDIR(st.st_mode)) { close(fd); respond_errno(id, EISDIR); return; }
    if (!S_ISREG(st.st_mode)) { close(fd); respond_errno(id, EINVAL); return; }  /* a pipe, socket or device */
    buf_t data = {0};
    char chunk[65536];
    for (;;) {
        ssize_t n = read(fd, chunk, sizeof(chunk));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { int e = errno; close(fd); buf_free(&data); respond_errno(id, e); return; }
        if (n == 0) break;
        if ((int64_t)(data.len + (size_t)n) > r->max_bytes) { close(fd); buf_free(&data); respond_errno(id, EFBIG); return; }
        buf_put(&data, chunk, (size_t)n);
    }
    close(fd);
    buf_t b = {0};
    field(&b, T_DATA, data.data ? data.data : "", data.len);
    respond(id, K_DATA, &b);
    buf_free(&b);
    buf_free(&data);
}

static void do_write(uint32_t id, req_t *r) {
    const char *path = r->path ? r->path : "";
    if (r->parents) {
        int e = mkdirs(path);
        if (e) { respond_errno(id, e); return; }
    }
    /* O_NONBLOCK: a named pipe would wait for a reader (ENXIO now, or opened and refused below) */
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, (mode_t)(r->mode & 07777));
    if (fd < 0) { respond_errno(id, errno == ENXIO ? EINVAL : errno); return; }
    struct stat st;
    if (fstat(fd, &st) != 0) { int e = errno; close(fd); respond_errno(id, e); return; }
    if (!S_ISREG(st.st_mode)) { close(fd); respond_errno(id, EINVAL); return; }  /* a pipe, socket or device */
    if (ftruncate(fd, 0) != 0) { int e = errno; close(fd); respond_errno(id, e); return; }
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    size_t off = 0;
    while (off < r->data_n) {
        ssize_t n = write(fd, r->data_p + off, r->data_n - off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { int e = errno; close(fd); respond_errno(id, e); return; }
        off += (size_t)n;
    }
    int e = 0;
    if (fchmod(fd, (mode_t)(r->mode & 07777)) != 0) e = errno;
    if (!e && r->uid >= 0 && fchown(fd, (uid_t)r->uid, (gid_t)(r->gid >= 0 ? r->gid : r->uid)) != 0) e = errno;
    if (close(fd) != 0 && !e) e = errno;
    if (e) { respond_errno(id, e); return; }
    respond(id, K_OK, NULL);
}

static void do_list(uint32_t id, req_t *r) {
    const char *path = r->path ? r->path : "";
    DIR *d = opendir(path);
    if (!d) { respond_errno(id, errno); return; }
    buf_t b = {0};
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        unsigned char entry[13];
        entry[0] = S_ISREG(st.st_mode) ? 'f' : S_ISDIR(st.st_mode) ? 'd' : S_ISLNK(st.st_mode) ? 'l' : 'o';
        for (int i = 0; i < 8; i++) entry[1 + i] = ((uint64_t)st.st_size >> (8 * i)) & 255;
        for (int i = 0; i < 4; i++) entry[9 + i] = ((uint32_t)st.st_mode >> (8 * i)) & 255;
        buf_t e = {0};
        buf_put(&e, entry, sizeof(entry));
        buf_put(&e, de->d_name, strlen(de->d_name));
        field(&b, T_ENTRY, e.data, e.len);
        buf_free(&e);
    }
    closedir(d);
    respond(id, K_LIST, &b);
    buf_free(&b);
}

/* Kill every process of the workspace but this one and pid 1; returns how many kills were sent. */
static int64_t kill_all(void) {
    int64_t killed = 0;
    pid_t self = getpid();
    for (int round = 0; round < 50; round++) {
        int found = 0;
        DIR *d = opendir("/proc");
        if (!d) break;
        struct dirent *de;
        while ((de = readdir(d))) {
            char *end;
            long pid = strtol(de->d_name, &end, 10);
            if (*end || pid <= 1 || pid == self) continue;
            if (kill((pid_t)pid, SIGKILL) == 0) { killed++; found = 1; }
        }
        closedir(d);
        reap();
        if (!found) break;
        struct timespec ts = {0, 10 * 1000000};
        nanosleep(&ts, NULL);
        reap();
    }
    return killed;
}

static void handle(const unsigned char *frame, size_t n) {
    if (n < 5) return;
    uint32_t id = get_u32(frame);
    uint8_t op = frame[4];
    req_t r;
    if (parse(frame + 5, n - 5, &r) != 0) { respond_errno(id, EINVAL); return; }
    buf_t b = {0};
    switch (op) {
    case OP_EXEC: do_exec(id, &r); break;
    case OP_READ: do_read(id, &r); break;
    case OP_WRITE: do_write(id, &r); break;
    case OP_LIST: do_list(id, &r); break;
    case OP_KILLALL:
        field_i64(&b, T_KILLED, kill_all());
        respond(id, K_OK, &b);
        break;
    case OP_CANCEL:
        for (int i = 0; i < MAX_CHILDREN; i++)
            if (children[i].used && children[i].id == (uint32_t)r.target) kill_group(&children[i]);
        respond(id, K_OK, NULL);
        break;
    case OP_PING: respond(id, K_OK, NULL); break;
    default: respond_errno(id, ENOSYS);
    }
    buf_free(&b);
    free_req(&r);
}

static void on_sigchld(int sig) {
    (void)sig;
    int saved = errno;
    if (write(sig_pipe[1], "c", 1) < 0) { /* the pipe is full: a wake-up is pending anyway */ }
    errno = saved;
}

static void shutdown_all(void) {
    kill_all();
    _exit(0);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    /* Orphans of commands come to us (not only when we are pid 1), so their zombies are reaped here. */
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    signal(SIGTERM, SIG_DFL);
    if (pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return 71;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigchld;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    set_nonblock(0);
    respond(0, K_READY, NULL);

    struct pollfd fds[2 + 3 * MAX_CHILDREN];
    child_t *owner[2 + 3 * MAX_CHILDREN];
    int kind[2 + 3 * MAX_CHILDREN];
    for (;;) {
        int nfds = 0;
        fds[nfds] = (struct pollfd){0, POLLIN, 0}; owner[nfds] = NULL; kind[nfds++] = 0;
        fds[nfds] = (struct pollfd){sig_pipe[0], POLLIN, 0}; owner[nfds] = NULL; kind[nfds++] = 1;
        int64_t now = now_ms(), wake = -1;
        for (int i = 0; i < MAX_CHILDREN; i++) {
            child_t *c = &children[i];
            if (!c->used) continue;
            if (!c->exited && now >= c->deadline_ms && !c->timed_out) {
                c->timed_out = 1;
                kill_group(c);
            }
            if (c->exited && ((c->out_fd < 0 && c->err_fd < 0) || now >= c->exit_ms + DRAIN_MS)) {
                finish(c);
                continue;
            }
            int64_t due = c->exited ? c->exit_ms + DRAIN_MS : c->deadline_ms;
            if (wake < 0 || due < wake) wake = due;
            if (c->out_fd >= 0) { fds[nfds] = (struct pollfd){c->out_fd, POLLIN, 0}; owner[nfds] = c; kind[nfds++] = 2; }
            if (c->err_fd >= 0) { fds[nfds] = (struct pollfd){c->err_fd, POLLIN, 0}; owner[nfds] = c; kind[nfds++] = 3; }
            if (c->in_fd >= 0) { fds[nfds] = (struct pollfd){c->in_fd, POLLOUT, 0}; owner[nfds] = c; kind[nfds++] = 4; }
        }
        int timeout = wake < 0 ? -1 : (int)(wake - now > 0 ? wake - now : 0);
        int ready = poll(fds, (nfds_t)nfds, timeout);
        if (ready < 0 && errno != EINTR) return 72;
        if (ready <= 0) continue;
        for (int k = 0; k < nfds; k++) {
            if (!fds[k].revents) continue;
            child_t *c = owner[k];
            switch (kind[k]) {
            case 0: {
                char chunk[65536];
                ssize_t n = read(0, chunk, sizeof(chunk));
                if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) shutdown_all();
                if (n > 0) buf_put(&inbuf, chunk, (size_t)n);
                size_t off = 0;
                while (inbuf.len - off >= 4) {
                    uint32_t len = get_u32((unsigned char *)inbuf.data + off);
                    if (inbuf.len - off - 4 < len) break;
                    handle((unsigned char *)inbuf.data + off + 4, len);
                    off += 4 + len;
                }
                if (off) {
                    memmove(inbuf.data, inbuf.data + off, inbuf.len - off);
                    inbuf.len -= off;
                }
                break;
            }
            case 1: {
                char drain[256];
                while (read(sig_pipe[0], drain, sizeof(drain)) > 0) {}
                reap();
                break;
            }
            case 2: if (c->used && c->out_fd >= 0) read_output(c, &c->out_fd, &c->out); break;
            case 3: if (c->used && c->err_fd >= 0) read_output(c, &c->err_fd, &c->err); break;
            case 4: if (c->used && c->in_fd >= 0) write_stdin(c); break;
            }
        }
    }
}
