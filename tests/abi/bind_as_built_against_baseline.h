/* Force-included into the program built against the 0.2.0 baseline header (tests/CMakeLists.txt):
 * a program linked against a 0.2 library recorded the 0.1 versions of the _init functions whose
 * structs 0.3 grew, so this one binds to those versions too, as that program would at run time;
 * linking against today's library would otherwise pick their 0.3 default versions, which write the
 * larger struct. One line per symbol that abi/smartgen.map lists in more than one node. */
#ifndef SMARTGEN_BIND_AS_BUILT_AGAINST_BASELINE_H
#define SMARTGEN_BIND_AS_BUILT_AGAINST_BASELINE_H
__asm__(".symver sg_transfer_options_init, sg_transfer_options_init@SMARTGEN_0.1");
__asm__(".symver sg_transfer_stats_init, sg_transfer_stats_init@SMARTGEN_0.1");
#endif
