// A library that exports its own, unversioned copy of a libstdc++ function, as a PyTorch wheel's
// libtorch.so does: std::filesystem::remove_all(const path&, error_code&), which here removes
// nothing and returns kCopyMarker. cxx_runtime_binding_test links it before the C++ runtime.
#include <cstdint>

extern "C" std::uintmax_t CopyOfRemoveAll(const void* path, void* ec) __asm__(
    "_ZNSt10filesystem10remove_allERKNS_7__cxx114pathERSt10error_code");
extern "C" std::uintmax_t CopyOfRemoveAll(const void*, void*) { return 4242; }
