/*
 * smartgen-info: what SmartGen would run on, here.
 *
 * Prints the loaded library's version, then every fabric provider libfabric reports as the runtime
 * ranks them (sg_provider_query): which are usable, which one a context picks for a peer on another
 * host and which one a session picks for a peer on this host, and why the others were rejected.
 *
 * usage: smartgen-info [--addr ADDR] [--json] [--directory ENDPOINTS [--prefix P]] [--help]
 *   --addr ADDR  local address the data endpoint would bind to (default: the library's, 127.0.0.1);
 *                name the NIC address to see what a cross-host context would use
 *   --json       one JSON object per provider per line, nothing else on stdout
 *   --directory ENDPOINTS  instead: the engines published in the etcd cluster at ENDPOINTS
 *                (sg_directory_list), one name a line (with --json, {"name": ...} lines)
 *
 * Exit status: 0 when at least one provider is usable, 2 when none is, 1 on error; with
 * --directory 0 when the cluster answered, 1 when it did not.
 *
 * Written against <smartgen/smartgen.h> only: the libfabric FI_MR_* bits are restated below.
 */
#include <smartgen/smartgen.h>

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* libfabric memory-registration mode bits (rdma/fabric.h), as sg_provider_info_t.mr_mode reports
 * them. Bits 0 and 1 are the pre-1.5 FI_MR_BASIC / FI_MR_SCALABLE modes. */
#define FI_MR_BASIC (1ull << 0)
#define FI_MR_SCALABLE (1ull << 1)
#define FI_MR_LOCAL (1ull << 2)
#define FI_MR_RAW (1ull << 3)
#define FI_MR_VIRT_ADDR (1ull << 4)
#define FI_MR_ALLOCATED (1ull << 5)
#define FI_MR_PROV_KEY (1ull << 6)
#define FI_MR_MMU_NOTIFY (1ull << 7)
#define FI_MR_RMA_EVENT (1ull << 8)
#define FI_MR_ENDPOINT (1ull << 9)
#define FI_MR_HMEM (1ull << 10)

static const struct {
    uint64_t bit;
    const char *name;
} MR_BITS[] = {
    {FI_MR_BASIC, "FI_MR_BASIC"},         {FI_MR_SCALABLE, "FI_MR_SCALABLE"},
    {FI_MR_LOCAL, "FI_MR_LOCAL"},         {FI_MR_RAW, "FI_MR_RAW"},
    {FI_MR_VIRT_ADDR, "FI_MR_VIRT_ADDR"}, {FI_MR_ALLOCATED, "FI_MR_ALLOCATED"},
    {FI_MR_PROV_KEY, "FI_MR_PROV_KEY"},   {FI_MR_MMU_NOTIFY, "FI_MR_MMU_NOTIFY"},
    {FI_MR_RMA_EVENT, "FI_MR_RMA_EVENT"}, {FI_MR_ENDPOINT, "FI_MR_ENDPOINT"},
    {FI_MR_HMEM, "FI_MR_HMEM"},
};
#define NUM_MR_BITS (sizeof MR_BITS / sizeof MR_BITS[0])

#define MR_MODE_ZERO "scalable (offsets, app keys)"

/* Length of a char array field that the library should have NUL-terminated, bounded by the array
 * size in case it did not (so a bad entry cannot make this tool read past it). */
static size_t field_len(const char *s, size_t cap)
{
    size_t n = 0;
    while (n < cap && s[n] != '\0')
        n++;
    return n;
}

/* mr_mode as "FI_MR_LOCAL|FI_MR_VIRT_ADDR|...", unknown bits as hex, 0 spelled out. */
static void mr_mode_str(uint64_t mode, char *buf, size_t cap)
{
    size_t i, len = 0;
    uint64_t rest = mode;

    buf[0] = '\0';
    if (mode == 0) {
        snprintf(buf, cap, "%s", MR_MODE_ZERO);
        return;
    }
    for (i = 0; i < NUM_MR_BITS; i++) {
        if (mode & MR_BITS[i].bit) {
            len += (size_t)snprintf(buf + len, len < cap ? cap - len : 0, "%s%s", len ? "|" : "",
                                    MR_BITS[i].name);
            rest &= ~MR_BITS[i].bit;
        }
        if (len >= cap)
            return; /* truncated; snprintf kept it terminated */
    }
    if (rest != 0)
        snprintf(buf + len, cap - len, "%s0x%" PRIx64, len ? "|" : "", rest);
}

/* For the text output only: NUL-terminates each string field (truncating one that filled its
 * array) and turns control characters into spaces, so one odd reason cannot break the table. */
static void sanitize_field(char *s, size_t cap)
{
    size_t i;

    s[cap - 1] = '\0';
    for (i = 0; s[i] != '\0'; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7F)
            s[i] = ' ';
}

static void sanitize(sg_provider_info_t *p)
{
    sanitize_field(p->name, sizeof p->name);
    sanitize_field(p->fabric, sizeof p->fabric);
    sanitize_field(p->domain, sizeof p->domain);
    sanitize_field(p->reason, sizeof p->reason);
}

/* A byte count for people: exact multiples of KiB/MiB/GiB/TiB in that unit, else the number
 * (providers with no limit report SIZE_MAX). */
static void bytes_str(uint64_t v, char *buf, size_t cap)
{
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
    int u = -1;

    if (v == UINT64_MAX) {
        snprintf(buf, cap, "2^64-1");
        return;
    }

    while (u < 3 && v >= 1024 && v % 1024 == 0) {
        v /= 1024;
        u++;
    }
    if (u < 0)
        snprintf(buf, cap, "%" PRIu64, v);
    else
        snprintf(buf, cap, "%" PRIu64 " %s", v, units[u]);
}

/* ---- JSON ----------------------------------------------------------------------------------- */

/* Writes a JSON string literal. Bytes >= 0x80 pass through (names are ASCII/UTF-8 in practice). */
static void json_str(const char *s, size_t len)
{
    size_t i;

    putchar('"');
    for (i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': fputs("\\\"", stdout); break;
        case '\\': fputs("\\\\", stdout); break;
        case '\b': fputs("\\b", stdout); break;
        case '\f': fputs("\\f", stdout); break;
        case '\n': fputs("\\n", stdout); break;
        case '\r': fputs("\\r", stdout); break;
        case '\t': fputs("\\t", stdout); break;
        default:
            if (c < 0x20 || c == 0x7F)
                printf("\\u%04x", c);
            else
                putchar(c);
        }
    }
    putchar('"');
}
#define JSON_FIELD(f) json_str((f), field_len((f), sizeof(f)))

/* One line per provider. Bit masks are hex strings (they exceed 2^53, which many JSON readers cannot
 * hold exactly); sizes are plain numbers. mr_mode_names is mr_mode decoded, for convenience. */
static void print_json(const sg_provider_info_t *p)
{
    char mr[512];
    size_t i, n = 0;

    fputs("{\"name\":", stdout);
    JSON_FIELD(p->name);
    fputs(",\"fabric\":", stdout);
    JSON_FIELD(p->fabric);
    fputs(",\"domain\":", stdout);
    JSON_FIELD(p->domain);
    printf(",\"caps\":\"0x%016" PRIx64 "\"", p->caps);
    printf(",\"mr_mode\":\"0x%" PRIx64 "\"", p->mr_mode);
    fputs(",\"mr_mode_names\":[", stdout);
    for (i = 0; i < NUM_MR_BITS; i++) {
        if (p->mr_mode & MR_BITS[i].bit) {
            printf("%s\"%s\"", n++ ? "," : "", MR_BITS[i].name);
        }
    }
    putchar(']');
    mr_mode_str(p->mr_mode, mr, sizeof mr);
    fputs(",\"mr_mode_text\":", stdout);
    json_str(mr, strlen(mr));
    printf(",\"msg_order\":\"0x%" PRIx64 "\"", p->msg_order);
    printf(",\"max_msg_size\":%" PRIu64, p->max_msg_size);
    printf(",\"rma_iov_limit\":%" PRIu64, p->rma_iov_limit);
    printf(",\"inject_size\":%" PRIu64, p->inject_size);
    printf(",\"usable\":%s", p->usable ? "true" : "false");
    printf(",\"rank\":%" PRId32, p->rank);
    printf(",\"chosen_remote\":%s", p->chosen_remote ? "true" : "false");
    printf(",\"chosen_local\":%s", p->chosen_local ? "true" : "false");
    fputs(",\"reason\":", stdout);
    JSON_FIELD(p->reason);
    fputs("}\n", stdout);
}

/* ---- text ------------------------------------------------------------------------------------ */

static int max_int(int a, int b) { return a > b ? a : b; }

static void print_table(const sg_provider_info_t *ps, size_t n)
{
    /* Column widths fitted to the data; reason is last and free-running. */
    int wn = 4, wf = 6, wd = 6, wm = 7;
    char mr[512], maxmsg[32], inject[32];
    size_t i;

    for (i = 0; i < n; i++) {
        wn = max_int(wn, (int)strlen(ps[i].name));
        wf = max_int(wf, (int)strlen(ps[i].fabric));
        wd = max_int(wd, (int)strlen(ps[i].domain));
        mr_mode_str(ps[i].mr_mode, mr, sizeof mr);
        wm = max_int(wm, (int)strlen(mr));
    }

    printf("  %-*s  %-*s  %-*s  %-6s  %4s  %-*s  %12s  %7s  %10s  %s\n", wn, "NAME", wf, "FABRIC", wd,
           "DOMAIN", "USABLE", "RANK", wm, "MR_MODE", "MAX_MSG_SIZE", "RMA_IOV", "INJECT", "REASON");
    for (i = 0; i < n; i++) {
        const sg_provider_info_t *p = &ps[i];
        char rank[16];

        mr_mode_str(p->mr_mode, mr, sizeof mr);
        bytes_str(p->max_msg_size, maxmsg, sizeof maxmsg);
        bytes_str(p->inject_size, inject, sizeof inject);
        if (p->rank < 0)
            snprintf(rank, sizeof rank, "-");
        else
            snprintf(rank, sizeof rank, "%" PRId32, p->rank);
        printf("  %-*s  %-*s  %-*s  %-6s  %4s  %-*s  %12s  %7" PRIu64 "  %10s  %s\n", wn, p->name, wf, p->fabric,
               wd, p->domain, p->usable ? "yes" : "no", rank, wm, mr, maxmsg, p->rma_iov_limit, inject, p->reason);
    }
}

static void print_choice(const char *label, const sg_provider_info_t *ps, size_t n, int remote)
{
    size_t i;

    for (i = 0; i < n; i++) {
        if (remote ? ps[i].chosen_remote : ps[i].chosen_local) {
            if (remote)
                printf("for a peer on another host: %s (%s)\n", ps[i].name, ps[i].reason);
            else
                printf("for a peer on this host: %s\n", ps[i].name);
            return;
        }
    }
    printf("%s: none\n", label);
}

/* ps: sanitized (see sanitize). */
static void print_text(const char *addr, const sg_provider_info_t *ps, size_t n)
{
    size_t i, rejected = 0;

    printf("SmartGen %s (ABI %" PRIu32 "; built against header %d.%d.%d, ABI %d)\n", sg_version_string(),
           sg_abi_version(), SG_VERSION_MAJOR, SG_VERSION_MINOR, SG_VERSION_PATCH, SG_ABI_VERSION);
    if (sg_version_number() / 10000u != (uint32_t)SG_VERSION_MAJOR)
        printf("warning: the loaded library's major version differs from this tool's header\n");
    printf("\nproviders for local address %s (%lu found, ranked; lower rank is preferred):\n",
           addr ? addr : "127.0.0.1 (default)", (unsigned long)n);
    if (n == 0)
        printf("  (none: libfabric reported no provider)\n");
    else
        print_table(ps, n);

    printf("\n");
    print_choice("for a peer on another host", ps, n, 1);
    print_choice("for a peer on this host", ps, n, 0);

    printf("\nrejected:\n");
    for (i = 0; i < n; i++) {
        if (!ps[i].usable) {
            printf("  %s (%s): %s\n", ps[i].name, ps[i].domain, ps[i].reason);
            rejected++;
        }
    }
    if (rejected == 0)
        printf("  (none)\n");
}

/* ---- main ---------------------------------------------------------------------------------- */

static void usage(FILE *out)
{
    fputs("usage: smartgen-info [--addr ADDR] [--json] [--directory ENDPOINTS [--prefix P]] [--help]\n"
          "  Shows the SmartGen version and the fabric providers it can use, ranked.\n"
          "  --addr ADDR  local address the data endpoint would bind to (default 127.0.0.1);\n"
          "               name the NIC address to see what a cross-host context would use\n"
          "  --json       one JSON object per provider per line\n"
          "  --directory ENDPOINTS  list the engines published in that etcd cluster instead\n"
          "               (\"http://h1:2379,http://h2:2379\"); --prefix its key prefix (/smartgen/)\n"
          "  --help       this text\n"
          "exit status: 0 a provider is usable (or the directory answered), 2 none is, 1 error\n",
          out);
}

/* Fills *out with every provider (caller frees). The list can change between the sizing call and
 * the filling call (a NIC appears), so a short buffer is retried with the new count. */
static sg_status_t query_all(const char *addr, sg_provider_info_t **out, size_t *count)
{
    sg_provider_info_t *ps = NULL;
    size_t n = 0, i;
    sg_status_t st;
    int attempt;

    /* Sizing call: NULL with capacity 0 answers SG_OK with the count (the header's caller-buffer rule). */
    st = sg_provider_query(addr, NULL, 0, &n);
    if (st != SG_OK)
        return st;

    for (attempt = 0; attempt < 5; attempt++) {
        size_t cap = n, got = 0;

        free(ps);
        ps = NULL;
        if (cap == 0)
            break;
        ps = calloc(cap, sizeof *ps);
        if (ps == NULL)
            return SG_ERR_NO_MEMORY;
        for (i = 0; i < cap; i++)
            ps[i].struct_size = sizeof ps[i]; /* tells the library which fields this tool knows */
        st = sg_provider_query(addr, ps, cap, &got);
        n = got; /* with SG_ERR_BUFFER_TOO_SMALL: the new count, nothing filled; retry with it */
        if (st == SG_OK) {
            *out = ps;
            *count = n;
            return SG_OK;
        }
        if (st != SG_ERR_BUFFER_TOO_SMALL) {
            free(ps);
            return st;
        }
    }
    free(ps);
    if (n != 0)
        return SG_ERR_AGAIN; /* the count kept changing */
    *out = NULL;
    *count = 0;
    return SG_OK;
}

/* The names published in the directory at `endpoints`, one a line. */
static int list_directory(const char *endpoints, const char *prefix, int json)
{
    sg_directory_options_t o;
    sg_directory_t dir = NULL;
    sg_error_info_t err;
    size_t len = 0, count = 0, at;
    char *names;
    sg_status_t st;

    sg_directory_options_init(&o);
    o.endpoints = endpoints;
    o.prefix = prefix;
    sg_error_info_init(&err);
    st = sg_directory_open(NULL, &o, &dir, &err);
    if (st != SG_OK) {
        fprintf(stderr, "smartgen-info: directory %s: %s (%s)\n", endpoints, err.message, sg_status_str(st));
        return 1;
    }
    /* The set can grow between the sizing call and the filling one: retry a few times. */
    names = NULL;
    for (int attempt = 0; attempt < 5; attempt++) {
        st = sg_directory_list(dir, NULL, 5000000000ull, NULL, 0, &len, &count);
        if (st != SG_OK)
            break;
        free(names);
        names = malloc(len ? len : 1);
        if (names == NULL) {
            st = SG_ERR_NO_MEMORY;
            break;
        }
        st = sg_directory_list(dir, NULL, 5000000000ull, names, len, &len, &count);
        if (st != SG_ERR_BUFFER_TOO_SMALL)
            break;
    }
    if (st != SG_OK) {
        fprintf(stderr, "smartgen-info: directory %s: %s (%s)\n", endpoints, sg_last_error_message(), sg_status_str(st));
        free(names);
        sg_directory_destroy(dir);
        return 1;
    }
    if (!json)
        printf("%zu engine%s published at %s\n", count, count == 1 ? "" : "s", endpoints);
    for (at = 0; at < len; at += strlen(names + at) + 1) {
        if (json) /* names are letters, digits, '.', '_', '-' and '/': nothing to escape */
            printf("{\"name\": \"%s\"}\n", names + at);
        else
            printf("  %s\n", names + at);
    }
    free(names);
    sg_directory_destroy(dir);
    return 0;
}

int main(int argc, char **argv)
{
    const char *addr = NULL, *directory = NULL, *prefix = NULL;
    int json = 0, i;
    sg_provider_info_t *ps = NULL;
    size_t n = 0, k;
    sg_status_t st;
    int usable = 0;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--addr") == 0 && i + 1 < argc) {
            addr = argv[++i];
        } else if (strcmp(argv[i], "--directory") == 0 && i + 1 < argc) {
            directory = argv[++i];
        } else if (strcmp(argv[i], "--prefix") == 0 && i + 1 < argc) {
            prefix = argv[++i];
        } else if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "smartgen-info: unknown or incomplete argument '%s'\n", argv[i]);
            usage(stderr);
            return 1;
        }
    }

    if (directory)
        return list_directory(directory, prefix, json);

    st = query_all(addr, &ps, &n);
    if (st == SG_ERR_NO_PROVIDER) {
        /* Not an error of this tool: report "nothing usable". */
        if (!json)
            fprintf(stderr, "smartgen-info: %s\n", sg_last_error_message());
        ps = NULL;
        n = 0;
    } else if (st != SG_OK) {
        /* Copy the detail first: any SmartGen call may replace it. */
        char detail[SG_ERROR_MESSAGE_MAX];
        snprintf(detail, sizeof detail, "%s", sg_last_error_message());
        fprintf(stderr, "smartgen-info: sg_provider_query failed: %s (%d)%s%s\n", sg_status_str(st), (int)st,
                detail[0] ? ": " : "", detail);
        return 1;
    }

    for (k = 0; k < n; k++)
        usable |= ps[k].usable ? 1 : 0;

    if (json) {
        for (k = 0; k < n; k++)
            print_json(&ps[k]);
    } else {
        for (k = 0; k < n; k++)
            sanitize(&ps[k]);
        print_text(addr, ps, n);
    }

    free(ps);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        perror("smartgen-info: stdout");
        return 1;
    }
    return usable ? 0 : 2;
}
