#include "server/model/io/restricted_unpickler.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/model_io/test_helpers.h"

namespace collabserve::model::io {
namespace {

using ::testing::HasSubstr;

std::string Str(const std::string& s) {  // BINUNICODE
  std::string out = "X";
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((s.size() >> (8 * i)) & 0xff));
  return out + s;
}
std::string ShortStr(const std::string& s) {  // SHORT_BINUNICODE
  return std::string("\x8c") + static_cast<char>(s.size()) + s;
}

const std::string kOrderedDict = "ccollections\nOrderedDict\n)R";

// A one-tensor state dict exactly as torch.save writes it (memo puts elided), with the given
// storage numel and tensor size/stride tuples.
std::string StateDict(int numel, const std::string& size, const std::string& stride) {
  return B("\x80\x02") + kOrderedDict + "(" + Str("w") + "ctorch._utils\n_rebuild_tensor_v2\n((" + Str("storage") +
         "ctorch\nFloatStorage\n" + Str("0") + Str("cpu") + "K" + std::string(1, static_cast<char>(numel)) + "tQ" +
         B("K\x00") + size + stride + "\x89" + kOrderedDict + "tRu.";
}

absl::Status Unpickle(const std::string& p) { return UnpickleStateDict(p, "m.bin: data.pkl").status(); }

TEST(RestrictedUnpicklerTest, ReadsATorchStateDict) {
  auto r = UnpickleStateDict(StateDict(6, B("K\x02K\x03\x86"), B("K\x03K\x01\x86")), "m");
  ASSERT_TRUE(r.ok()) << r.status();
  const PyValue* root = (*r)->root;
  ASSERT_EQ(root->kind, PyKind::kDict);
  ASSERT_EQ(root->dict.size(), 1u);
  EXPECT_EQ(root->dict[0].first->s, "w");
  const PyValue* t = root->dict[0].second;
  ASSERT_EQ(t->kind, PyKind::kTensor);
  EXPECT_EQ(t->size, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t->stride, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(t->storage->s, "0");
  EXPECT_EQ(t->storage->numel, 6);
  EXPECT_EQ(t->storage->dtype, DType::kF32);
}

TEST(RestrictedUnpicklerTest, ReadsProtocol4AllowedStackGlobalsAndTorch2Forms) {
  // FRAME, STACK_GLOBAL + MEMOIZE for OrderedDict, a 7-argument _rebuild_tensor_v2 (metadata) wrapped
  // in _rebuild_parameter, BINUNICODE8 and BINGET of a memoized global.
  const std::string od = ShortStr("collections") + ShortStr("OrderedDict") + "\x93\x94";  // memo 0
  const std::string p = B("\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00") + od + ")R" + "(" +
                        B("\x8d\x01\x00\x00\x00\x00\x00\x00\x00") + "p" +
                        ShortStr("torch._utils") + ShortStr("_rebuild_parameter") + "\x93" +
                        ShortStr("torch._utils") + ShortStr("_rebuild_tensor_v2") + "\x93" + "((" + Str("storage") +
                        ShortStr("torch") + ShortStr("HalfStorage") + "\x93" + Str("k") + Str("cpu") + "K\x04" +
                        "tQ" + B("K\x01K\x03\x85K\x01\x85\x89") + B("h\x00") + ")RNtR" + "\x88" + B("h\x00") +
                        ")R\x87R" + "u.";
  auto r = UnpickleStateDict(p, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  const PyValue* root = (*r)->root;
  ASSERT_EQ(root->kind, PyKind::kDict);
  ASSERT_EQ(root->dict.size(), 1u);
  EXPECT_EQ(root->dict[0].first->s, "p");
  const PyValue* t = root->dict[0].second;
  ASSERT_EQ(t->kind, PyKind::kTensor);
  EXPECT_EQ(t->i, 1);
  EXPECT_EQ(t->size, std::vector<int64_t>{3});
  EXPECT_EQ(t->storage->dtype, DType::kF16);
}

TEST(RestrictedUnpicklerTest, ReadsScalarsOfEveryEncoding) {
  const std::string p = B("\x80\x02(K\x07M\x01\x02J\xfe\xff\xff\xff\x8a\x02\x00\x80\x8a\x00G?\xf8\x00\x00\x00\x00\x00\x00"
                          "\x88\x89N") + ShortStr("s") + "t.";
  auto r = UnpickleStateDict(p, "m");
  ASSERT_TRUE(r.ok()) << r.status();
  const auto& items = (*r)->root->items;
  ASSERT_EQ(items.size(), 10u);
  EXPECT_EQ(items[0]->i, 7);
  EXPECT_EQ(items[1]->i, 513);
  EXPECT_EQ(items[2]->i, -2);
  EXPECT_EQ(items[3]->i, -32768);
  EXPECT_EQ(items[4]->i, 0);
  EXPECT_EQ(items[5]->f, 1.5);
  EXPECT_TRUE(items[6]->b);
  EXPECT_FALSE(items[7]->b);
  EXPECT_EQ(items[8]->kind, PyKind::kNone);
  EXPECT_EQ(items[9]->s, "s");
}

TEST(RestrictedUnpicklerTest, RefusesOsSystemViaGlobal) {
  EXPECT_INVALID(Unpickle(B("\x80\x02") + "cos\nsystem\n" + Str("touch /tmp/pwned") + "\x85R."),
                 "m.bin: data.pkl: global 'os.system' is not allowed in a state dict");
}

TEST(RestrictedUnpicklerTest, RefusesPosixSystemViaGlobal) {
  EXPECT_INVALID(Unpickle(B("\x80\x02") + "cposix\nsystem\n" + Str("id") + "\x85R."),
                 "global 'posix.system' is not allowed in a state dict");
}

TEST(RestrictedUnpicklerTest, RefusesBuiltinsEvalViaGlobal) {
  EXPECT_INVALID(Unpickle(B("\x80\x02") + "cbuiltins\neval\n" + Str("1+1") + "\x85R."),
                 "global 'builtins.eval' is not allowed in a state dict");
}

TEST(RestrictedUnpicklerTest, RefusesSubprocessPopenViaGlobal) {
  EXPECT_INVALID(Unpickle(B("\x80\x02") + "csubprocess\nPopen\n" + Str("ls") + "\x85R."),
                 "global 'subprocess.Popen' is not allowed in a state dict");
}

TEST(RestrictedUnpicklerTest, RefusesOsSystemViaStackGlobal) {
  EXPECT_INVALID(Unpickle(B("\x80\x04") + ShortStr("os") + ShortStr("system") + "\x93" + ShortStr("id") + "\x85R."),
                 "m.bin: data.pkl: global 'os.system' is not allowed in a state dict");
}

TEST(RestrictedUnpicklerTest, RefusesBuiltinsEvalViaStackGlobal) {
  EXPECT_INVALID(Unpickle(B("\x80\x04") + ShortStr("builtins") + ShortStr("eval") + "\x93" + ShortStr("1") + "\x85R."),
                 "global 'builtins.eval' is not allowed in a state dict");
}

TEST(RestrictedUnpicklerTest, RefusesSubprocessPopenViaStackGlobal) {
  EXPECT_INVALID(Unpickle(B("\x80\x04") + ShortStr("subprocess") + ShortStr("Popen") + "\x93" + ShortStr("ls") + "\x85R."),
                 "global 'subprocess.Popen' is not allowed in a state dict");
}

TEST(RestrictedUnpicklerTest, RefusesLookalikeGlobals) {
  EXPECT_INVALID(Unpickle(B("\x80\x02" "ctorch\nload\n.")), "global 'torch.load' is not allowed");
  EXPECT_INVALID(Unpickle(B("\x80\x02" "ctorch._utils\n_rebuild_tensor_v2x\n.")), "is not allowed");
  EXPECT_INVALID(Unpickle(B("\x80\x02" "ccollections \nOrderedDict\n.")), "is not allowed");
}

TEST(RestrictedUnpicklerTest, RefusesOpcodesThatCallOrConstructThings) {
  EXPECT_INVALID(Unpickle(B("\x80\x02(ios\nsystem\n.")), "opcode 0x69 is not supported in a state dict");  // INST
  EXPECT_INVALID(Unpickle(B("\x80\x02(o.")), "opcode 0x6f is not supported");                              // OBJ
  EXPECT_INVALID(Unpickle(B("\x80\x02" "ccollections\nOrderedDict\n)\x81.")), "opcode 0x81 is not supported");  // NEWOBJ
  EXPECT_INVALID(Unpickle(B("\x80\x02" "ctorch\nFloatStorage\n)R.")),
                 "calling 'torch.FloatStorage' is not allowed in a state dict");
}

TEST(RestrictedUnpicklerTest, HugeMemoIndex) {
  EXPECT_INVALID(Unpickle(B("\x80\x02Nr\xff\xff\xff\xff.")), "memo index 4294967295 is over the limit of 1048576");
  EXPECT_INVALID(Unpickle(B("\x80\x02j\x00\x00\x10\x00.")), "memo index 1048576 was never set");
}

TEST(RestrictedUnpicklerTest, UnterminatedPickle) {
  EXPECT_INVALID(Unpickle(B("\x80\x02}")), "m.bin: data.pkl: pickle ends without STOP (truncated or unterminated)");
  EXPECT_INVALID(Unpickle(B("\x80\x02X\xff\x00\x00\x00" "ab")), "pickle is truncated inside an opcode's argument");
  EXPECT_INVALID(Unpickle(B("\x80\x02" "cos\nsys")), "truncated inside a GLOBAL");
  EXPECT_INVALID(Unpickle(""), "pickle ends without STOP");
}

TEST(RestrictedUnpicklerTest, DeepNesting) {
  EXPECT_INVALID(Unpickle(B("\x80\x02") + std::string(200000, '(')), "more than 1000 nested MARKs");
  EXPECT_INVALID(Unpickle(B("\x80\x02N") + std::string(100000, '\x85') + "."), "containers nest deeper than 64 levels");
  std::string lists = B("\x80\x02");
  for (int i = 0; i < 100; ++i) lists += "]";
  for (int i = 0; i < 99; ++i) lists += "a";
  EXPECT_INVALID(Unpickle(lists + "."), "containers nest deeper than 64 levels");
}

TEST(RestrictedUnpicklerTest, SelfReferenceNeitherHangsNorCrashes) {
  auto r = UnpickleStateDict(B("\x80\x02]q\x00h\x00" "a."), "m");  // l = []; l.append(l)
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->root->items[0], (*r)->root);
}

TEST(RestrictedUnpicklerTest, ObjectBudget) {
  PickleLimits limits;
  limits.max_objects = 1000;
  std::string p = B("\x80\x02](");
  for (int i = 0; i < 2000; ++i) p += "N";
  p += "e.";
  EXPECT_INVALID(UnpickleStateDict(p, "m", limits).status(), "more than 1000 objects");
}

TEST(RestrictedUnpicklerTest, TensorOutsideItsStorage) {
  EXPECT_INVALID(Unpickle(StateDict(6, B("K\x02K\x04\x86"), B("K\x04K\x01\x86"))),
                 "tensor with offset 0 reaches element 7 of storage '0' which has 6 elements");
  EXPECT_INVALID(Unpickle(StateDict(6, B("K\x02\x85"), B("K\x03K\x01\x86"))), "size has 1 dims but stride has 2");
  EXPECT_INVALID(Unpickle(StateDict(6, B("J\xff\xff\xff\xff\x85"), B("K\x01\x85"))), "size has out-of-range value -1");
  EXPECT_INVALID(Unpickle(StateDict(6, B("\x8a\x06\x00\x00\x00\x00\x00\x01K\x02\x86"),
                                    B("\x8a\x06\x00\x00\x00\x00\x00\x01K\x01\x86"))),
                 "tensor size/stride overflow 64 bits");
}

TEST(RestrictedUnpicklerTest, ExpandedViewsMayNotClaimMoreThanTheirStorage) {
  // position_ids-style expand: shape (1, 6), stride (0, 1) over 6 elements is fine.
  EXPECT_TRUE(Unpickle(StateDict(6, B("K\x01K\x06\x86"), B("K\x00K\x01\x86"))).ok());
  // Shape (2^40,) stride (0,) over 6 elements would let a tiny file claim 4 TB.
  EXPECT_INVALID(Unpickle(StateDict(6, B("\x8a\x06\x00\x00\x00\x00\x00\x01\x85"), B("K\x00\x85"))),
                 "tensor has 1099511627776 elements but its storage '0' only 6 (an overlapping view)");
}

TEST(RestrictedUnpicklerTest, MalformedPersistentId) {
  EXPECT_INVALID(Unpickle(B("\x80\x02") + Str("storage") + "\x85Q."),
                 "persistent id is not ('storage', type, key, location, numel)");
  EXPECT_INVALID(Unpickle(B("\x80\x02(") + Str("storage") + "ccollections\nOrderedDict\n" + Str("0") + Str("cpu") +
                          "K\x01tQ."),
                 "storage type is not a torch.*Storage class");
}

TEST(RestrictedUnpicklerTest, StackMisuse) {
  EXPECT_INVALID(Unpickle(B("\x80\x02R.")), "stack underflow");
  EXPECT_INVALID(Unpickle(B("\x80\x02NN.")), "STOP with 2 values on the stack, not 1");
  EXPECT_INVALID(Unpickle(B("\x80\x02NNs.")), "SETITEM without a dict");
  EXPECT_INVALID(Unpickle(B("\x80\x02]NNs.")), "SETITEM(S) on a list, not a dict");
  EXPECT_INVALID(Unpickle(B("\x80\x02N)b.")), "BUILD of a None with a tuple is not supported");
  EXPECT_INVALID(Unpickle(B("\x80\x09.")), "unsupported pickle protocol 9");
}

}  // namespace
}  // namespace collabserve::model::io
