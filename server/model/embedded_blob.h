// COLLABSERVE_EMBED_FILE(sym, "path"): the file at `path` (absolute, read when the assembler runs)
// as read-only data between sym_begin and sym_end, followed by one NUL byte that is not part of it.
// For CMake-generated sources only: a compiler cache does not see the file, so the generating
// source must carry the file's checksum (see server/model/CMakeLists.txt).
#ifndef COLLABSERVE_SERVER_MODEL_EMBEDDED_BLOB_H_
#define COLLABSERVE_SERVER_MODEL_EMBEDDED_BLOB_H_

#define COLLABSERVE_EMBED_FILE(sym, path)                  \
  asm(".section .rodata." #sym ",\"a\",@progbits\n"       \
      ".balign 64\n"                                      \
      ".global " #sym "_begin\n" #sym "_begin:\n"         \
      ".incbin \"" path "\"\n"                            \
      ".global " #sym "_end\n" #sym "_end:\n"             \
      ".byte 0\n"                                         \
      ".previous\n");                                     \
  extern "C" const char sym##_begin[];                    \
  extern "C" const char sym##_end[];

#endif  // COLLABSERVE_SERVER_MODEL_EMBEDDED_BLOB_H_
