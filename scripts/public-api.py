#!/usr/bin/env python3
"""The crate's public API, one item per line, sorted, against the committed list.

    scripts/public-api.py            # check: exits 1 and prints the difference if it changed
    scripts/public-api.py --update   # write the list (review the diff, commit it)
    scripts/public-api.py --list F   # print the list of rustdoc JSON file F

Builds rustdoc's JSON output with the stable toolchain (`RUSTC_BOOTSTRAP=1 cargo rustdoc --lib
--all-features -- -Z unstable-options --output-format json`: format 57 with rustc 1.95) and
compares it with api/public-api.txt, so every change to the surface is deliberate and reviewed.

Walks from the crate root through public modules and re-exports (as a user reaches items:
`mralloc::transfer::Connection`), and lists each item with its kind and, for functions and
methods, its signature; for structs their public fields; for enums their variants; for traits
their items and every implementation of them (foreign types and blanket impls included);
inherent methods and trait impls of the crate's types. Auto-trait impls and the copies rustdoc
derives from blanket impls are left out, except Send/Sync, whose loss would break users.
"""
import difflib
import json
import os
import subprocess
import sys


LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "api", "public-api.txt")


def main():
    args = sys.argv[1:]
    if args[:1] == ["--list"]:
        print("\n".join(api_of(args[1])))
        return 0
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, RUSTC_BOOTSTRAP="1")
    cmd = ["cargo", "rustdoc", "--lib", "--all-features", "--color", "never", "--",
           "-Z", "unstable-options", "--output-format", "json"]
    r = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(r.stdout, file=sys.stderr)
        print("public-api: cargo rustdoc (JSON) failed", file=sys.stderr)
        return 2
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    now = api_of(os.path.join(target, "doc", "mralloc.json"))
    if args[:1] == ["--update"]:
        os.makedirs(os.path.dirname(LIST), exist_ok=True)
        with open(LIST, "w") as f:
            f.write("\n".join(now) + "\n")
        print(f"public-api: {len(now)} items written to api/public-api.txt")
        return 0
    try:
        want = open(LIST).read().splitlines()
    except FileNotFoundError:
        want = []
    if now == want:
        print(f"public-api: {len(now)} items, as committed")
        return 0
    diff = difflib.unified_diff(want, now, "api/public-api.txt (committed)", "the crate now", lineterm="", n=0)
    print("\n".join(diff))
    print("public-api: the public API differs from api/public-api.txt; if the change is deliberate, "
          "run scripts/public-api.py --update and commit the list with it", file=sys.stderr)
    return 1


def api_of(json_path):
    doc = json.load(open(json_path))
    if doc.get("format_version") != 57:
        print(f"public-api: rustdoc JSON format {doc.get('format_version')} (this script reads 57)", file=sys.stderr)
    index = doc["index"]
    paths = doc["paths"]
    root = str(doc["root"])
    out = set()
    seen = set()

    def item(i):
        return index.get(str(i))

    def name_of(i):
        p = paths.get(str(i))
        if p:
            return "::".join(p["path"])
        it = item(i)
        return it["name"] if it else "?"

    def generic_args(a):
        if not a:
            return ""
        if "angle_bracketed" in a:
            parts = []
            for x in a["angle_bracketed"]["args"]:
                if "type" in x:
                    parts.append(ty(x["type"]))
                elif "lifetime" in x:
                    parts.append(x["lifetime"])
                elif "const" in x:
                    parts.append(x["const"].get("expr", "_"))
                else:
                    parts.append("_")
            for c in a["angle_bracketed"].get("constraints", []):
                b = c.get("binding", {})
                if "equality" in b:
                    parts.append(f"{c['name']} = {ty(b['equality'].get('type', {}))}")
                else:
                    parts.append(f"{c['name']}: {bounds(b.get('constraint', []))}")
            return "<" + ", ".join(parts) + ">" if parts else ""
        if "parenthesized" in a:
            p = a["parenthesized"]
            s = "(" + ", ".join(ty(t) for t in p["inputs"]) + ")"
            if p.get("output"):
                s += " -> " + ty(p["output"])
            return s
        return ""

    # The path a user names an item of this crate by (the shortest public one, found by a first
    # walk), so moving an item between private modules changes nothing here.
    public = {}

    def path_of(p):
        # Else the full path where rustdoc knows it (`Error` could be the crate's or std::io's).
        known = paths.get(str(p.get("id")))
        name = public.get(str(p.get("id"))) or ("::".join(known["path"]) if known else p["path"])
        return name + generic_args(p.get("args"))

    def bounds(bs):
        r = []
        for b in bs:
            if "trait_bound" in b:
                r.append(("?" if b["trait_bound"]["modifier"] == "maybe" else "") + path_of(b["trait_bound"]["trait"]))
            elif "outlives" in b:
                r.append(b["outlives"])
            else:
                r.append("use<..>")
        return " + ".join(r)

    def ty(t):
        if t is None:
            return "()"
        k, v = next(iter(t.items()))
        if k == "resolved_path":
            return path_of(v)
        if k == "generic":
            return v
        if k == "primitive":
            return v
        if k == "borrowed_ref":
            lt = (v["lifetime"] + " ") if v.get("lifetime") else ""
            return "&" + lt + ("mut " if v["is_mutable"] else "") + ty(v["type"])
        if k == "raw_pointer":
            return ("*mut " if v["is_mutable"] else "*const ") + ty(v["type"])
        if k == "slice":
            return "[" + ty(v) + "]"
        if k == "array":
            return "[" + ty(v["type"]) + "; " + v["len"] + "]"
        if k == "tuple":
            return "(" + ", ".join(ty(x) for x in v) + ")"
        if k == "impl_trait":
            return "impl " + bounds(v)
        if k == "dyn_trait":
            return "dyn " + " + ".join(path_of(x["trait"]) for x in v["traits"])
        if k == "qualified_path":
            tr = path_of(v["trait"]) if v.get("trait") else ""
            return f"<{ty(v['self_type'])} as {tr}>::{v['name']}"
        if k == "function_pointer":
            return "fn(" + ", ".join(ty(x[1]) for x in v["sig"]["inputs"]) + ") -> " + ty(v["sig"]["output"])
        if k == "infer":
            return "_"
        return k

    def generics(g):
        ps = []
        for p in g["params"]:
            k = p["kind"]
            if "lifetime" in k:
                ps.append(p["name"])
            elif "type" in k:
                if k["type"].get("is_synthetic"):
                    continue
                b = bounds(k["type"]["bounds"])
                ps.append(p["name"] + (": " + b if b else ""))
            elif "const" in k:
                ps.append(f"const {p['name']}: {ty(k['const']['type'])}")
        w = []
        for wp in g["where_predicates"]:
            if "bound_predicate" in wp:
                w.append(ty(wp["bound_predicate"]["type"]) + ": " + bounds(wp["bound_predicate"]["bounds"]))
        return ("<" + ", ".join(ps) + ">" if ps else "") + (" where " + ", ".join(w) if w else "")

    def fn_sig(name, f):
        h = f["header"]
        pre = ("const " if h.get("is_const") else "") + ("async " if h.get("is_async") else "")
        pre += "unsafe " if h.get("is_unsafe") else ""
        ins = ", ".join(f"{n}: {ty(t)}" for n, t in f["sig"]["inputs"])
        ins = ins.replace("self: Self", "self").replace("self: &Self", "&self").replace("self: &mut Self", "&mut self")
        out = f["sig"]["output"]
        return f"{pre}fn {name}{generics(f['generics'])}({ins})" + (f" -> {ty(out)}" if out else "")

    def impl_items(prefix, impl, only_public):
        for m in impl["items"]:
            mi = item(m)
            if mi is None or (only_public and mi["visibility"] != "public"):
                continue
            k, v = next(iter(mi["inner"].items()))
            if k == "function":
                out.add(fn_sig(f"{prefix}::{mi['name']}", v))
            elif k == "assoc_const":
                out.add(f"const {prefix}::{mi['name']}: {ty(v['type'])}")
            elif k == "assoc_type":
                out.add(f"type {prefix}::{mi['name']}" + (f" = {ty(v['type'])}" if v.get("type") else ""))

    def impls(path, ids):
        for i in ids:
            im = item(i)
            if im is None:
                continue
            v = im["inner"]["impl"]
            if v["is_synthetic"] or v["blanket_impl"]:
                if v["is_synthetic"] and v["trait"] and v["trait"]["path"] in ("Send", "Sync") and not v["is_negative"]:
                    out.add(f"impl {v['trait']['path']} for {ty(v['for'])} (auto)")
                continue
            if v["trait"] is None:
                impl_items(path, v, True)
            else:
                neg = "!" if v["is_negative"] else ""
                tr = path_of(v["trait"])
                out.add(f"impl{generics(v['generics'])} {neg}{tr} for {ty(v['for'])}")
                # The crate's own traits: their items are part of the surface.
                if str(v["trait"]["id"]) in index:
                    impl_items(f"<{path} as {v['trait']['path']}>", v, False)

    def visit(i, path):
        it = item(i)
        if it is None:
            return
        if (str(i), path) in seen:
            return
        seen.add((str(i), path))
        k, v = next(iter(it["inner"].items()))
        if k == "use":
            if v["id"] is None:
                out.add(f"{path}::{v['name']} (re-export of external {v['source']})")
                return
            if v["is_glob"]:
                t = item(v["id"])
                if t and "module" in t["inner"]:
                    for c in t["inner"]["module"]["items"]:
                        ci = item(c)
                        if ci and ci["visibility"] == "public":
                            visit(c, path)
                return
            t = item(v["id"])
            if t is None:
                out.add(f"{path}::{v['name']} (re-export of {name_of(v['id'])})")
                return
            visit_named(v["id"], t, f"{path}::{v['name']}")
            return
        visit_named(i, it, f"{path}::{it['name']}" if it["name"] else path)

    def visit_named(i, it, p):
        k, v = next(iter(it["inner"].items()))
        mine, name = public.get(str(i)), p.lstrip(":")
        if mine is None or (name.count("::"), name) < (mine.count("::"), mine):
            public[str(i)] = name
        attrs = " #[non_exhaustive]" if any("non_exhaustive" in str(a) for a in it.get("attrs", [])) else ""
        if k == "module":
            out.add(f"mod {p}")
            for c in v["items"]:
                ci = item(c)
                if ci and ci["visibility"] == "public":
                    visit(c, p)
        elif k == "struct":
            out.add(f"struct {p}{generics(v['generics'])}{attrs}")
            kind = v["kind"]
            fields = kind.get("plain", {}).get("fields", []) if isinstance(kind, dict) else []
            fields = fields or (kind.get("tuple") or [] if isinstance(kind, dict) else [])
            for n, f in enumerate(fields):
                fi = item(f) if f is not None else None
                if fi and fi["visibility"] == "public":
                    out.add(f"field {p}::{fi['name']}: {ty(fi['inner']['struct_field'])}")
            impls(p, v["impls"])
        elif k == "enum":
            out.add(f"enum {p}{generics(v['generics'])}{attrs}")
            for var in v["variants"]:
                vi = item(var)
                vk = vi["inner"]["variant"]["kind"]
                if vk == "plain":
                    out.add(f"variant {p}::{vi['name']}")
                elif "tuple" in vk:
                    fs = [ty(item(f)["inner"]["struct_field"]) if f is not None else "_" for f in vk["tuple"]]
                    out.add(f"variant {p}::{vi['name']}({', '.join(fs)})")
                else:
                    fs = [f"{item(f)['name']}: {ty(item(f)['inner']['struct_field'])}" for f in vk["struct"]["fields"]]
                    out.add(f"variant {p}::{vi['name']} {{ {', '.join(fs)} }}")
            impls(p, v["impls"])
        elif k == "union":
            out.add(f"union {p}")
            impls(p, v["impls"])
        elif k == "function":
            out.add(fn_sig(p, v))
        elif k == "trait":
            un = "unsafe " if v["is_unsafe"] else ""
            sup = bounds(v["bounds"])
            out.add(f"{un}trait {p}{generics(v['generics'])}" + (f": {sup}" if sup else ""))
            impl_items(p, v, False)
            # Its implementations, also those for foreign types (`[u8]`, `Vec<&L>`) and the
            # blanket ones, which no type of the crate lists.
            for im_id in v.get("implementations", []):
                im = item(im_id)
                if im is None or im["inner"]["impl"]["is_synthetic"]:
                    continue
                iv = im["inner"]["impl"]
                neg = "!" if iv["is_negative"] else ""
                out.add(f"impl{generics(iv['generics'])} {neg}{path_of(iv['trait'])} for {ty(iv['for'])}")
        elif k == "constant":
            out.add(f"const {p}: {ty(v['type'])}")
        elif k == "static":
            out.add(f"static {p}: {ty(v['type'])}")
        elif k == "type_alias":
            out.add(f"type {p}{generics(v['generics'])} = {ty(v['type'])}")
        elif k == "macro":
            out.add(f"macro {p}!")
        else:
            out.add(f"{k} {p}")

    visit(root, "")
    # Again, now that every item's public path is known.
    out.clear()
    seen.clear()
    visit(root, "")
    return sorted(line.replace(" ::", " ").replace("<::", "<") for line in out)


if __name__ == "__main__":
    sys.exit(main())
