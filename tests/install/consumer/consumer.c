/* Built against an installed SmartGen: the header it compiled with and the library it loaded must
 * agree, and the library must work (a context, the provider it chose). */
#include <smartgen/smartgen.h>
#include <stdio.h>

int main(void)
{
    sg_context_options_t options;
    sg_context_t ctx = NULL;
    sg_error_info_t err;
    char provider[64];

    if (sg_version_number() != SG_VERSION_NUMBER || sg_abi_version() != SG_ABI_VERSION) {
        fprintf(stderr, "header %d (ABI %d) but library %u (ABI %u)\n", SG_VERSION_NUMBER, SG_ABI_VERSION,
                sg_version_number(), sg_abi_version());
        return 1;
    }
    sg_context_options_init(&options);
    options.provider = "tcp";
    options.allow_unauthenticated = 1; /* no session is made */
    sg_error_info_init(&err);
    if (sg_context_create(&options, &ctx, &err) != SG_OK) {
        fprintf(stderr, "sg_context_create: %s\n", err.message);
        return 1;
    }
    if (sg_context_provider(ctx, provider, sizeof provider) != SG_OK) {
        fprintf(stderr, "sg_context_provider: %s\n", sg_last_error_message());
        return 1;
    }
    printf("consumer: SmartGen %s, provider %s\n", sg_version_string(), provider);
    return sg_context_destroy(ctx) == SG_OK ? 0 : 1;
}
