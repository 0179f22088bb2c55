/* Under an address-space limit (ulimit -v), calls that need more memory than is left return
 * SG_ERR_NO_MEMORY, as the header promises; the process never aborts. Each case runs in a child
 * whose limit is what it already maps plus a margin too small for the request. Exit 0 when every
 * case returned a status (NO_MEMORY where the allocation cannot fit). */
#define _GNU_SOURCE
#include <smartgen/smartgen.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

static long vm_size_kib(void) {
    long kib = -1;
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmSize: %ld kB", &kib) == 1) break;
    if (f) fclose(f);
    return kib;
}

/* A 60 MB profile: one long string value. Too large for 40 MiB of headroom, within the 64 MiB cap. */
static const size_t kProfileBytes = 60u << 20;

static void limit_to_current_plus(long margin_kib) {
    const rlim_t bytes = (rlim_t)(vm_size_kib() + margin_kib) * 1024;
    struct rlimit r = {bytes, bytes};
    if (setrlimit(RLIMIT_AS, &r) != 0) { perror("setrlimit"); _exit(3); }
}

static int run_case(const char *name, int which, const char *path) {
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        sg_status_t st;
        sg_error_info_t err;
        sg_error_info_init(&err);
        sg_profile_t p = NULL;
        if (which == 0) {
            limit_to_current_plus(40 * 1024);
            st = sg_profile_load(path, &p, &err);
        } else {
            char *text = malloc(kProfileBytes + 16);
            if (!text) _exit(3);
            memcpy(text, "{\"x\":\"", 6);
            memset(text + 6, 'a', kProfileBytes - 8);
            memcpy(text + kProfileBytes - 2, "\"}", 3);
            limit_to_current_plus(40 * 1024);
            st = sg_profile_parse(text, kProfileBytes, &p, &err);
        }
        printf("%s: %s (%s)\n", name, sg_status_str(st), err.message);
        fflush(stdout);
        sg_profile_destroy(p);
        _exit(st == SG_ERR_NO_MEMORY ? 0 : 2);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) {
        printf("FAIL: %s died with signal %d\n", name, WTERMSIG(status));
        return 1;
    }
    if (WEXITSTATUS(status) != 0) {
        printf("FAIL: %s did not return SG_ERR_NO_MEMORY\n", name);
        return 1;
    }
    return 0;
}

int main(void) {
    char path[] = "/tmp/smartgen-oom-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0) { perror("mkstemp"); return 3; }
    FILE *f = fdopen(fd, "w");
    fputs("{\"x\":\"", f);
    for (size_t i = 0; i < kProfileBytes - 8; ++i) fputc('a', f);
    fputs("\"}", f);
    fclose(f);
    int failed = run_case("sg_profile_load of a 60 MB file", 0, path);
    failed |= run_case("sg_profile_parse of 60 MB", 1, path);
    unlink(path);
    if (!failed) puts("ok: both returned SG_ERR_NO_MEMORY under the limit");
    return failed;
}
