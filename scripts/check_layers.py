#!/usr/bin/env python3
"""Checks daemon/'s include graph against the layers of docs/ARCHITECTURE.md.

The table between the markers "<!-- layers: begin -->" and "<!-- layers:
end -->" lists every module of daemon/: its layer (1 = bottom), its name and
its files. A file may include only headers of modules of its own layer or
lower, the modules of one layer must not include each other in a cycle, and
every file of daemon/ must be in exactly one module. Prints the modules'
graph and exits 1 with one line per violation.

  scripts/check_layers.py [--graph]
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DOC = os.path.join(ROOT, "docs", "ARCHITECTURE.md")
SRC = os.path.join(ROOT, "daemon")
GENERATED = {"version.h"}  # made by the build from version.h.in


def read_layers():
    text = open(DOC, encoding="utf-8").read()
    m = re.search(r"<!-- layers: begin -->(.*?)<!-- layers: end -->", text, re.S)
    if not m:
        sys.exit(f"{DOC}: no layers table between the markers")
    modules = {}  # name -> (layer, files)
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        layer, name = int(cells[0]), cells[1].strip("`")
        files = [f.strip().strip("`") for f in cells[2].split(",") if f.strip()]
        if name in modules:
            sys.exit(f"{DOC}: module {name} is listed twice")
        modules[name] = (layer, files)
    return modules


def main():
    modules = read_layers()
    owner, errors = {}, []
    for name, (_, files) in modules.items():
        for f in files:
            if f in owner:
                errors.append(f"{f} is in modules {owner[f]} and {name}")
            owner[f] = name
    present = {f for f in os.listdir(SRC)
               if f.endswith((".c", ".h", ".cc")) and not f.startswith(".")}
    for f in sorted(present - set(owner)):
        errors.append(f"daemon/{f} is in no module of the layers table")
    for f in sorted(set(owner) - present):
        errors.append(f"the layers table lists {f}, which is not in daemon/")
    edges = {name: set() for name in modules}
    for f in sorted(present & set(owner)):
        src = open(os.path.join(SRC, f), encoding="utf-8").read()
        mod = owner[f]
        layer = modules[mod][0]
        for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', src, re.M):
            base = os.path.basename(inc)
            if base in GENERATED or base not in owner:
                continue  # generated code, or a header outside daemon/
            dep = owner[base]
            if dep == mod:
                continue
            edges[mod].add(dep)
            if modules[dep][0] > layer:
                errors.append(f"daemon/{f} (layer {layer}, {mod}) includes {base} "
                              f"(layer {modules[dep][0]}, {dep})")
    # No cycle among modules (within a layer is the only place one could hide).
    state = {}

    def visit(n, path):
        state[n] = 1
        for d in sorted(edges[n]):
            if state.get(d) == 1:
                cyc = path[path.index(d):] + [d] if d in path else [n, d]
                errors.append("include cycle: " + " -> ".join(cyc))
            elif d not in state:
                visit(d, path + [d])
        state[n] = 2
    for n in sorted(modules):
        if n not in state:
            visit(n, [n])
    if "--graph" in sys.argv:
        for n in sorted(modules, key=lambda x: (-modules[x][0], x)):
            print(f"{modules[n][0]:2d} {n:14s} -> {', '.join(sorted(edges[n])) or '-'}")
    for e in errors:
        print("layers:", e)
    if errors:
        return 1
    print(f"layers: {len(modules)} modules of daemon/ in {len({l for l, _ in modules.values()})} "
          f"layers, no include upwards, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
