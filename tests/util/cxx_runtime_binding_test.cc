// The executables bind the C++ runtime's own functions even when a library listed before it
// exports copies of them (a PyTorch wheel's libtorch.so does, unversioned; its
// std::filesystem::remove_all(path, error_code&) jumped to address 0 there, and every test that
// removed a temporary directory crashed). The top-level CMakeLists.txt lists libstdc++ first.
// This test links LibTorch and a library that exports such a copy (exports_std_copies.cc), both
// before libstdc++ as CMake orders them.
#include <dlfcn.h>
#include <ftw.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include <ATen/ATen.h>

namespace {

using RemoveAllFn = std::uintmax_t (*)(const std::filesystem::path&, std::error_code&);

int RemoveEntry(const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }

// The file of the object that defines the function this executable calls.
std::string DefiningObject(const void* fn) {
  Dl_info info{};
  if (::dladdr(fn, &info) == 0 || info.dli_fname == nullptr) return "(unknown)";
  return info.dli_fname;
}

TEST(CxxRuntimeBindingTest, RemoveAllIsTheRuntimesOwn) {
  const RemoveAllFn bound = &std::filesystem::remove_all;
  const std::string object = DefiningObject(reinterpret_cast<const void*>(bound));
  EXPECT_NE(object.find("libstdc++"), std::string::npos)
      << "std::filesystem::remove_all binds to " << object;
}

TEST(CxxRuntimeBindingTest, RemoveAllRemovesATree) {
  // LibTorch is in the process (a copy in its libtorch.so is what this guards against).
  ASSERT_EQ(at::ones({2}).sum().item<float>(), 2.0f);
  const std::filesystem::path root =
      std::filesystem::temp_directory_path() / ("collabserve-binding-" + std::to_string(::getpid()));
  std::filesystem::create_directories(root / "a" / "b");
  std::ofstream(root / "a" / "b" / "f") << "x";
  std::error_code ec;
  const std::uintmax_t removed = std::filesystem::remove_all(root, ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_EQ(removed, 4u) << "4242 is the exported copy's answer";
  EXPECT_FALSE(std::filesystem::exists(root));
  // Where the copy answered, the tree is still there: removed without std::filesystem.
  if (std::filesystem::exists(root)) ::nftw(root.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
}

}  // namespace
