/* Run inside the clean root after libsmartgen-cuda0 is installed: a SG_MEM_CUDA pool must find the
 * plugin beside libsmartgen and load it without any CUDA toolkit (its runtime is linked in); with no
 * NVIDIA driver in the root, the refusal names the driver, not a missing plugin. Exit 0 when so. */
#include <smartgen/smartgen.h>

#include <stdio.h>
#include <string.h>

int main(void) {
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.allow_unauthenticated = 1;
    sg_context_t ctx = NULL;
    if (sg_context_create(&o, &ctx, NULL) != SG_OK) return 2;
    static char k[4096], v[4096];
    void *kb[1] = {k}, *vb[1] = {v};
    sg_kv_layout_t l;
    sg_kv_layout_init(&l);
    l.num_layers = 1;
    l.num_kv_heads = 1;
    l.head_dim = 64;
    l.tokens_per_block = 16;
    l.num_blocks = 2;
    l.mem_kind = SG_MEM_CUDA;
    l.layer_k_base = kb;
    l.layer_v_base = vb;
    l.layer_base_count = 1;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_kv_handle_t kv = NULL;
    const sg_status_t st = sg_kv_register(ctx, &l, &kv, &err);
    printf("%s: %s\n", sg_status_str(st), err.message);
    sg_context_destroy(ctx);
    return st == SG_ERR_UNSUPPORTED && strstr(err.message, "driver") && !strstr(err.message, "needs the CUDA plugin") ? 0 : 1;
}
