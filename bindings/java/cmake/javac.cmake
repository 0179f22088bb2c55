# Compiles every .java file under SOURCE_DIRS ("|"-separated: the list is only known at build time,
# since SWIG writes the raw layer's classes then) into CLASSES_DIR, from scratch so that a deleted
# source leaves no class behind, and packs them into JAR_FILE when one is given.
#   cmake -DJAVAC=... -DSOURCE_DIRS=a|b -DCLASSES_DIR=... [-DCLASSPATH=x:y] [-DJAR=... -DJAR_FILE=...]
#         [-DSTAMP=...] -P javac.cmake
string(REPLACE "|" ";" dirs "${SOURCE_DIRS}")
set(sources "")
foreach(dir IN LISTS dirs)
  file(GLOB_RECURSE found "${dir}/*.java")
  list(APPEND sources ${found})
endforeach()
if(NOT sources)
  message(FATAL_ERROR "no Java sources under ${SOURCE_DIRS}")
endif()
list(SORT sources)

file(REMOVE_RECURSE "${CLASSES_DIR}")
file(MAKE_DIRECTORY "${CLASSES_DIR}")
set(cp_args "")
if(CLASSPATH)
  set(cp_args -cp "${CLASSPATH}")
endif()
execute_process(COMMAND "${JAVAC}" --release 17 -encoding UTF-8 -Xlint:all -d "${CLASSES_DIR}" ${cp_args} ${sources}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "javac failed (${rc})")
endif()
if(JAR_FILE)
  execute_process(COMMAND "${JAR}" --create --file "${JAR_FILE}" -C "${CLASSES_DIR}" . RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "jar failed (${rc})")
  endif()
endif()
if(STAMP)
  file(TOUCH "${STAMP}")
endif()
