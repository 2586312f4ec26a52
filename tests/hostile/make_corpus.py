#!/usr/bin/python3
"""Writes tests/hostile/corpus/: malicious checkpoint uploads, each with the reason it must be refused
(a substring of the error) in tests/hostile/corpus/expected.tsv. hostile_checkpoints_test reads every
file through ReadCheckpointFile and checks the refusal. Deterministic; rerun and commit after a
change. Needs Debian's python3 with torch (call /usr/bin/python3 explicitly).

    /usr/bin/python3 tests/hostile/make_corpus.py
"""
import collections
import io
import json
import os
import shutil
import struct
import zipfile
import zlib

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
MARKER = "/tmp/collabserve-hostile-pwned"  # a pickle that ran would create this
expected = []


def put(name, data, reason):
    assert len(data) < 200_000, name
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
    expected.append((name, reason))


# ---- pickles inside otherwise valid torch.save zips ----

class Reduce:
    """Pickles as a call of fn(*args); nothing is called while pickling."""
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def torch_save(obj, **kw):
    buf = io.BytesIO()
    torch.save(obj, buf, **kw)
    return buf.getvalue()


def stored_zip(entries, comment=b""):
    """A zip of stored entries written by hand: [(name, data)] -> bytes (no zip64)."""
    out, central = b"", b""
    for name, data in entries:
        n = name.encode() if isinstance(name, str) else name
        crc = zlib.crc32(data)
        off = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(data), len(data), len(n), 0) + n + data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, crc, len(data), len(data),
                               len(n), 0, 0, 0, 0, 0, off) + n
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(central), len(out), len(comment))
    return out + central + eocd + comment


def torch_zip_with_pickle(pkl, storages=()):
    entries = [("archive/data.pkl", pkl), ("archive/byteorder", b"little")]
    entries += [(f"archive/data/{k}", v) for k, v in storages]
    entries.append(("archive/version", b"3\n"))
    return stored_zip(entries)


def gen_pickles():
    touch = f"touch {MARKER}"
    import subprocess
    import builtins
    put("pickle_os_system.bin", torch_save({"w": Reduce(os.system, touch)}),
        "global 'posix.system' is not allowed")
    put("pickle_subprocess_popen.bin", torch_save({"w": Reduce(subprocess.Popen, ["touch", MARKER])}),
        "global 'commands.Popen' is not allowed")
    put("pickle_subprocess_check_output.bin", torch_save({"w": Reduce(subprocess.check_output, ["touch", MARKER])}),
        "global 'commands.check_output' is not allowed")
    put("pickle_builtins_eval.bin", torch_save({"w": Reduce(eval, f"__import__('os').system('{touch}')")}),
        "global '__builtin__.eval' is not allowed")
    put("pickle_builtins_exec.bin", torch_save({"w": Reduce(exec, f"import os; os.system('{touch}')")}),
        "global '__builtin__.exec' is not allowed")
    # A __reduce__ chain: getattr(__import__('os'), 'system')(touch), the callable itself built by calls.
    def u(text):
        return b"X" + struct.pack("<I", len(text)) + text.encode()
    put("pickle_reduce_chain.bin", torch_zip_with_pickle(
        b"\x80\x02}" + u("w") + b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n" + u("os") + b"\x85R" +
        u("system") + b"tR" + u(touch) + b"\x85Rs."),
        "global 'builtins.getattr' is not allowed")
    # The same with protocol 4 (STACK_GLOBAL) and an os.system hidden inside a tensor's arguments.
    put("pickle_stack_global_protocol4.bin", torch_save({"w": Reduce(os.system, touch)}, pickle_protocol=4),
        "global 'posix.system' is not allowed")
    put("pickle_inside_tensor_args.bin",
        torch_zip_with_pickle(b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n("
                              b"cposix\nsystem\nX" + struct.pack("<I", len(touch)) + touch.encode() +
                              b"\x85RK\x00)))tRs."),
        "global 'posix.system' is not allowed")
    # Callable values produced by an allowed global: OrderedDict() is a dict, and a dict is not callable.
    put("pickle_call_a_dict.bin", torch_zip_with_pickle(b"\x80\x02ccollections\nOrderedDict\n)R)R."),
        "REDUCE on a dict, not an allowed callable")
    put("pickle_instance_opcodes.bin", torch_zip_with_pickle(b"\x80\x02(cos\nsystem\nX\x02\x00\x00\x00lso."),
        "global 'os.system' is not allowed")
    put("pickle_inst_opcode.bin", torch_zip_with_pickle(b"\x80\x02(ios\nsystem\nX\x02\x00\x00\x00ls."),
        "opcode 0x69 is not supported")
    # Nested and recursive structures, memo abuse, "billion laughs".
    put("pickle_deep_nesting.bin", torch_zip_with_pickle(b"\x80\x02" + b"]" * 20_000 + b"a" * 19_999 + b"."),
        "nest deeper than")
    put("pickle_many_marks.bin", torch_zip_with_pickle(b"\x80\x02" + b"(" * 20_000 + b"}."), "nested MARKs")
    put("pickle_self_referencing_dict.bin",
        torch_zip_with_pickle(b"\x80\x02}q\x00X\x01\x00\x00\x00wh\x00s."), "not a tensor")
    put("pickle_self_referencing_list.bin",
        torch_zip_with_pickle(b"\x80\x02}X\x01\x00\x00\x00w]q\x00h\x00as."), "not a tensor")
    # 40 levels, each a list of 10 references to the previous: 10^40 leaves if expanded.
    laughs = b"\x80\x02}X\x01\x00\x00\x00w](]X\x03\x00\x00\x00lolaq\x00"
    for i in range(1, 41):
        laughs += b"](" + (b"j" + struct.pack("<I", i - 1)) * 10 + b"er" + struct.pack("<I", i)
    laughs += b"es."
    put("pickle_billion_laughs.bin", torch_zip_with_pickle(laughs), "not a tensor")
    put("pickle_huge_memo_put.bin", torch_zip_with_pickle(b"\x80\x02}r\xff\xff\xff\x7f."), "memo index 2147483647 is over the limit")
    put("pickle_huge_memo_get.bin", torch_zip_with_pickle(b"\x80\x02}j\xff\xff\xff\x7f."), "memo index 2147483647 was never set")
    put("pickle_unset_memo.bin", torch_zip_with_pickle(b"\x80\x02}h\x05."), "memo index 5 was never set")
    put("pickle_huge_string_length.bin", torch_zip_with_pickle(b"\x80\x02}\x8d\xff\xff\xff\xff\xff\xff\xff\x7f."),
        "truncated inside an opcode's argument")
    put("pickle_unterminated.bin", torch_zip_with_pickle(b"\x80\x02}q\x00"), "without STOP")
    # A tensor view reaching outside its storage, and a storage larger than its entry.
    put("pickle_tensor_outside_storage.bin", torch_zip_with_pickle(
        b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\n"
        b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQK\x02K\x04\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRs.",
        [("0", b"\0" * 16)]), "reaches element 5 of storage '0' which has 4 elements")
    put("pickle_storage_bigger_than_entry.bin", torch_zip_with_pickle(
        b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\n"
        b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuJ\x00\x00\x00\x40tQK\x00J\x00\x00\x00\x40\x85K\x01\x85\x89"
        b"ccollections\nOrderedDict\n)RtRs.", [("0", b"\0" * 16)]), "claims 1073741824 F32 elements but its entry has 16 bytes")
    legacy = io.BytesIO()
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    put("legacy_torch_save.bin", legacy.getvalue(), "legacy (pre-1.6, non-zip) torch.save format is not supported")


# ---- zip structure ----

def gen_zips():
    good = torch_save(collections.OrderedDict([("w", torch.ones(2, 2))]))
    z = zipfile.ZipFile(io.BytesIO(good))
    names = z.namelist()
    files = [(n, z.read(n)) for n in names]
    base = stored_zip(files)

    def patch_local(data, index, field_off, fmt, value):
        """Patch a field of the index-th local header of a stored_zip."""
        off = 0
        for _ in range(index):
            n, e = struct.unpack_from("<HH", data, off + 26)
            size = struct.unpack_from("<I", data, off + 18)[0]
            off += 30 + n + e + size
        b = bytearray(data)
        struct.pack_into(fmt, b, off + field_off, value)
        return bytes(b)

    def central_offset(data):
        eocd = data.rfind(struct.pack("<I", 0x06054B50))
        return eocd, struct.unpack_from("<I", data, eocd + 16)[0]

    def patch_central(data, index, field_off, fmt, value):
        _, off = central_offset(data)
        for _ in range(index):
            n, e, c = struct.unpack_from("<HHH", data, off + 28)
            off += 46 + n + e + c
        b = bytearray(data)
        struct.pack_into(fmt, b, off + field_off, value)
        return bytes(b)

    # Lying sizes: the central directory says an entry is larger (or smaller) than the local header.
    put("zip_lying_size_central.bin", patch_central(patch_central(base, 0, 20, "<I", 10_000), 0, 24, "<I", 10_000),
        "but the central directory says 10000 bytes")
    put("zip_lying_size_local.bin", patch_local(patch_local(base, 0, 18, "<I", 3), 0, 22, "<I", 3),
        "local header says 3 bytes")
    put("zip_size_past_end.bin", patch_central(patch_central(base, 1, 20, "<I", 0xFFFFFFF0), 1, 24, "<I", 0xFFFFFFF0),
        "central directory says 4294967280 bytes")
    eocd, cd = central_offset(base)
    b = bytearray(base); struct.pack_into("<HH", b, eocd + 8, 60000, 60000)
    put("zip_lying_entry_count.bin", bytes(b), "cannot hold 60000 entries")
    b = bytearray(base); struct.pack_into("<I", b, eocd + 12, 0x7FFFFFFF)
    put("zip_lying_central_directory_size.bin", bytes(b), "runs outside the file")
    b = bytearray(base); struct.pack_into("<I", b, eocd + 16, len(base) + 100)
    put("zip_central_directory_past_end.bin", bytes(b), "runs outside the file")
    # Overlapping entries: a second central record pointing at the first entry's local header (the
    # classic non-recursive zip bomb layout), and an entry whose data runs into the next one.
    _, cd = central_offset(base)
    first_len = 46 + struct.unpack_from("<H", base, cd + 28)[0]
    dup = bytearray(base[cd:cd + first_len])
    n = struct.unpack_from("<H", dup, 28)[0]
    dup[46:46 + n] = b"archive/data/9"[:n].ljust(n, b"x")
    eocd = base.rfind(struct.pack("<I", 0x06054B50))
    count = struct.unpack_from("<H", base, eocd + 10)[0]
    cd_size = struct.unpack_from("<I", base, eocd + 12)[0]
    tail = bytearray(base[eocd:])
    struct.pack_into("<HHI", tail, 8, count + 1, count + 1, cd_size + len(dup))
    put("zip_two_records_one_header.bin", base[:eocd] + bytes(dup) + bytes(tail), "local header names a different file")
    # Overlapping entries: 'archive/data/big' stores, as its data, the local header and data of the
    # next entry, so both read the same bytes.
    inner_name, inner = b"archive/data/0", b"\0" * 16
    inner_local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, zlib.crc32(inner), 16, 16,
                              len(inner_name), 0) + inner_name + inner
    outer_name = b"archive/data/big"
    outer_local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, zlib.crc32(inner_local),
                              len(inner_local), len(inner_local), len(outer_name), 0) + outer_name
    rest = [(n, d) for n, d in files if not n.startswith("archive/data/")]
    lead = stored_zip(rest)
    lead_cd = lead.rfind(struct.pack("<I", 0x02014B50), 0, lead.rfind(struct.pack("<I", 0x06054B50)))
    _, lead_cd = central_offset(lead)
    lead_eocd = lead.rfind(struct.pack("<I", 0x06054B50))
    body = lead[:lead_cd] + outer_local + inner_local
    def central(name, crc, size, off):
        return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, crc, size, size,
                           len(name), 0, 0, 0, 0, 0, off) + name
    cd = lead[lead_cd:lead_eocd] + central(outer_name, zlib.crc32(inner_local), len(inner_local), lead_cd) + \
        central(inner_name, zlib.crc32(inner), 16, lead_cd + len(outer_local))
    n_entries = len(rest) + 2
    put("zip_overlapping_entries.bin",
        body + cd + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n_entries, n_entries, len(cd), len(body), 0),
        "overlaps entry")
    # Absurd compression ratio: deflated entries (10 MB of zeros in 10 KB); we only read stored ones.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zz:
        for name, data in files:
            zz.writestr(name, data if not name.endswith("data.pkl") else data, compress_type=zipfile.ZIP_STORED)
        zz.writestr("archive/data/1", b"\0" * 10_000_000, compress_type=zipfile.ZIP_DEFLATED)
    put("zip_bomb_deflated.bin", buf.getvalue(), "is compressed (method 8, deflate)")
    # A stored entry claiming 1 TB: sizes agree between headers but not with the file.
    big = patch_local(patch_local(base, 1, 18, "<I", 0xFFFFFFFE), 1, 22, "<I", 0xFFFFFFFE)
    big = patch_central(patch_central(big, 1, 20, "<I", 0xFFFFFFFE), 1, 24, "<I", 0xFFFFFFFE)
    put("zip_absurd_stored_size.bin", big, "claims 4294967294 bytes")
    # Names outside the archive root.
    for tag, evil, reason in [
            ("dotdot", "../../../../tmp/collabserve-hostile-escape", "has a '..' component"),
            ("absolute", "/etc/cron.d/x", "is an absolute path"),
            ("backslash", "archive\\..\\..\\x", "has a backslash in its name"),
            ("inner_dotdot", "archive/data/../../../x", "has a '..' component"),
            ("nul", "archive/data/0\0.txt", "has a NUL byte in its name")]:
        put(f"zip_name_{tag}.bin", stored_zip(files + [(evil, b"x")]), reason)
    put("zip_duplicate_names.bin", stored_zip(files + [files[0]]), "appears twice")
    # Encrypted flag, spanning disks, a CRC that does not match.
    put("zip_encrypted.bin", patch_central(patch_local(base, 0, 6, "<H", 1), 0, 8, "<H", 1), "is encrypted")
    b = bytearray(base); eocd = base.rfind(struct.pack("<I", 0x06054B50)); struct.pack_into("<HH", b, eocd + 4, 1, 1)
    put("zip_multi_disk.bin", bytes(b), "multi-disk zip archives are not supported")
    b = bytearray(base); b[30 + struct.unpack_from("<H", base, 26)[0] + 2] ^= 0xFF  # a data byte
    put("zip_corrupt_data_crc.bin", bytes(b), "CRC")
    put("zip_truncated.bin", base[: len(base) // 2], "no end-of-central-directory record")
    put("zip_without_data_pkl.bin", stored_zip([(n, d) for n, d in files if not n.endswith("data.pkl")]),
        "zip has no <folder>/data.pkl entry")


# ---- safetensors ----

def st(header, data=b"", raw=None):
    h = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def gen_safetensors():
    f32 = lambda shape, off: {"dtype": "F32", "shape": shape, "data_offsets": off}
    put("st_overlapping.safetensors", st({"a": f32([2], [0, 8]), "b": f32([2], [4, 12])}, b"\0" * 12), "overlap tensor 'a'")
    put("st_aliased.safetensors", st({"a": f32([2], [0, 8]), "b": f32([2], [0, 8])}, b"\0" * 8), "overlap tensor")
    put("st_out_of_range.safetensors", st({"a": f32([25], [0, 100])}, b"\0" * 8), "run past the 8-byte data buffer")
    put("st_offset_past_u64.safetensors", st({"a": f32([2], [2**64 - 8, 2**64 - 1])}, b"\0" * 8),
        "run past the 8-byte data buffer")
    put("st_negative_offset.safetensors", st({"a": f32([2], [-8, 0])}, b"\0" * 8), "negative offset -8")
    put("st_reversed_offsets.safetensors", st({"a": f32([2], [8, 0])}, b"\0" * 8), "has begin after end")
    put("st_huge_header_length.safetensors", b"\xff" * 8 + b"{}", "is over the limit of 100000000 bytes")
    put("st_header_just_over_limit.safetensors", struct.pack("<Q", 100_000_001) + b"{}", "is over the limit")
    put("st_header_past_end.safetensors", struct.pack("<Q", 99_999_999) + b'{"a": 1}', "runs past the end")
    put("st_non_json_header.safetensors", st(None, raw=b"{\x00\xff\xfe not json at all"), "header is not valid JSON")
    put("st_header_not_object.safetensors", st(None, raw=b"[1, 2, 3]"), "header is not a JSON object")
    put("st_header_deep_nesting.safetensors", st(None, raw=b'{"a": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"), "entry must be an object, got an array")
    put("st_dtype_shape_mismatch.safetensors", st({"x": f32([3], [0, 8])}, b"\0" * 8), "is 8 bytes but F32 [3] needs 12")
    put("st_dtype_unknown.safetensors", st({"x": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "unsupported dtype 'F8_E4M3'")
    put("st_shape_overflow.safetensors", st({"x": f32([1 << 40, 1 << 40, 1 << 40], [0, 8])}, b"\0" * 8), "overflows 64 bits")
    put("st_negative_dim.safetensors", st({"x": f32([-1, -8], [0, 32])}, b"\0" * 32), "negative dim")
    put("st_rank_17.safetensors", st({"x": f32([1] * 17, [0, 4])}, b"\0" * 4), "more than 16 dims")
    put("st_duplicate_names.safetensors", st(None, b"\0" * 8, raw=b'{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[],"data_offsets":[4,8]}}'), "name appears twice")
    put("st_metadata_not_strings.safetensors", st({"__metadata__": {"k": {"nested": 1}}}), "__metadata__: value of 'k' must be a string")
    put("st_unknown_field.safetensors", st({"x": dict(f32([1], [0, 4]), extra=[1])}, b"\0" * 4), "unknown field 'extra'")
    put("st_empty_file.safetensors", b"", "shorter than the 8-byte header length")


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    gen_pickles()
    gen_zips()
    gen_safetensors()
    with open(os.path.join(OUT, "expected.tsv"), "w") as f:
        f.write("# file\tsubstring of the error that names the reason (see make_corpus.py)\n")
        for name, reason in expected:
            f.write(f"{name}\t{reason}\n")
    print(len(expected), "files,", sum(os.path.getsize(os.path.join(OUT, n)) for n, _ in expected), "bytes")
