/* The one SWIG interface of SmartGen, over the public header only (SWIG 4.1): Go (-go -cgo
 * -intgosize 64) and Java (JNI). What each language needs before the header is read (typemaps,
 * renames, the C shims that return a failing call's status and message together) lives in its own
 * file, included here; the raw layer SWIG generates stays internal to each binding, whose users see
 * the idiomatic API written on top of it. */
%module smartgen

%{
#include <smartgen/smartgen.h>
%}

%include <stdint.i>

#ifdef SWIGGO
%include "go.i"
#endif

#ifdef SWIGJAVA
%include "java.i"
#endif

%include <smartgen/smartgen.h>
