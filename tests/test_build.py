"""pie-build: text_completion builds into a component that instantiates and runs on stub imports."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from wasmtime import Engine, Store, WasiConfig
from wasmtime.component import Component, Linker, Record, ResourceType

from host.api import WIT_VERSION
from host.cli.build import BuildError, build_inferlet, main, resolve_inferlet
from host.cli.sources import entry_source, source_files, standard_dir, wit_dir

WIT = (wit_dir() / "inferlet.wit").read_text()
TEXT_COMPLETION = standard_dir() / "text_completion"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pie-cache")


@pytest.fixture(scope="module")
def built(cache: Path) -> tuple[Path, float]:
    mp = pytest.MonkeyPatch()
    mp.setenv("PIE_CACHE_DIR", str(cache))
    t0 = time.monotonic()
    path = build_inferlet(TEXT_COMPLETION, quiet=True)
    yield path, time.monotonic() - t0
    mp.undo()


@pytest.fixture(scope="module")
def component(built: tuple[Path, float]) -> tuple[Engine, Component]:
    engine = Engine()
    return engine, Component.from_file(engine, str(built[0]))


def wit_functions() -> dict[str, list[str]]:
    """interface -> function names, read from the WIT so a new import cannot go unnoticed."""
    out: dict[str, list[str]] = {}
    for m in re.finditer(r"interface ([\w-]+) \{(.*?)\n\}", WIT, re.S):
        body = m.group(2)
        out[m.group(1)] = re.findall(r"^    ([\w-]+): func", body, re.M)
        for res in re.finditer(r"^    resource ([\w-]+) \{(.*?)^    \}", body, re.S | re.M):  # resource functions
            out[m.group(1)] += [f"[{'static' if st else 'method'}]{res.group(1)}.{fn}"
                                for fn, st in re.findall(r"^        ([\w-]+): (static )?func", res.group(2), re.M)]
    return out


def wit_resources() -> dict[str, list[str]]:
    """interface -> resource names."""
    return {m.group(1): re.findall(r"^    resource ([\w-]+) \{", m.group(2), re.M)
            for m in re.finditer(r"interface ([\w-]+) \{(.*?)\n\}", WIT, re.S)}


def _record(**fields: object) -> Record:
    r = Record()
    for k, v in fields.items():
        setattr(r, k, v)
    return r


class StubHost:
    """Just enough of a host: fixed tokens from the 'model', pages from a counter."""

    def __init__(self, args: list[str], script: list[int]) -> None:
        self.args, self.script = args, list(script)
        self.returned: str | None = None
        self.calls: list[str] = []
        self.next_page = 0
        self.impl = {
            ("runtime", "arguments"): lambda: self.args,
            ("runtime", "set-return"): self._set_return,
            ("model", "apply-chat-template"): lambda msgs, gen: (
                "".join(f"<{m.role}>{m.content}" for m in msgs) + ("<assistant>" if gen else "")
            ),
            ("model", "chat-template"): lambda: "<stub template>",
            ("model", "encode"): lambda text: [ord(c) for c in text],
            ("model", "decode"): lambda ids: "".join(chr(i) for i in ids if i != 0),
            ("model", "stop-tokens"): lambda: [0],
            ("kv", "page-size"): lambda: 16,
            ("kv", "allocate"): self._allocate,
            ("kv", "release"): lambda pages: None,
            ("forward", "run"): self._run,
            ("forward", "decode-step"): lambda pages, last_len, token, pos, sampler: self.script.pop(0),
            ("forward", "generate"): self._generate,
            ("forward", "generate-fresh"): self._generate_fresh,
            ("kv", "attach-prefix"): lambda tokens: [],  # no prefix cache in the stub
        }

    def _generate(self, pages, last_len, tokens, positions, sampler, max_tokens, stops, texts, stream):  # noqa: ANN001
        drawn: list[int] = []
        while len(drawn) < max_tokens:
            drawn.append(self.script.pop(0))
            if drawn[-1] in stops:
                return _record(tokens=drawn, **{"new-pages": []}, trim=1, finish="stop-token")
        return _record(tokens=drawn, **{"new-pages": []}, trim=0, finish="length")

    def _generate_fresh(self, tokens, sampler, max_tokens, stops, texts, stream, prefix_cache):  # noqa: ANN001
        pages = self._allocate(-(-len(tokens) // 16))
        g = self._generate(pages, 0, tokens, [], sampler, max_tokens, stops, texts, stream)
        g.__dict__["new-pages"] = pages
        return g

    def _set_return(self, value: str) -> None:
        self.returned = value

    def _allocate(self, n: int) -> list[int]:
        self.next_page += n
        return list(range(self.next_page - n, self.next_page))

    def _run(self, pages, last_len, tokens, positions, mask, outputs):  # noqa: ANN001
        return [_record(token=self.script.pop(0) if o.sample else None, ids=[], probs=[])
                for o in outputs]  # fmt: skip

    def linker(self, engine: Engine) -> Linker:
        linker = Linker(engine)
        linker.add_wasip2()
        with linker.root() as root:
            for iface, funcs in wit_functions().items():
                with root.add_instance(f"pie:inferlet/{iface}@{WIT_VERSION}") as inst:
                    for i, res in enumerate(wit_resources()[iface]):  # the SDK makes none here
                        inst.add_resource(res, ResourceType.host(i + 1), lambda store, rep: None)
                    for name in funcs:
                        inst.add_func(name, self._stub(iface, name))
        return linker

    def _stub(self, iface: str, name: str):  # noqa: ANN202
        fn = self.impl.get((iface, name))

        def call(store: object, *args: object) -> object:
            self.calls.append(f"{iface}.{name}")
            if fn is None:
                raise RuntimeError(f"unexpected import call {iface}.{name}{args}")
            return fn(*args)

        return call


def run_component(engine: Engine, comp: Component, host: StubHost) -> object:
    store = Store(engine)
    store.set_wasi(WasiConfig())
    inst = host.linker(engine).instantiate(store, comp)
    return inst.get_func(store, "run")(store)


@pytest.mark.build
def test_build_produces_a_component(built: tuple[Path, float], component: tuple[Engine, Component]) -> None:
    path, _ = built
    assert path.suffix == ".wasm" and path.stat().st_size > 1_000_000
    assert path.read_bytes()[:4] == b"\0asm"


@pytest.mark.build
def test_component_runs_on_stub_imports(component: tuple[Engine, Component]) -> None:
    engine, comp = component
    host = StubHost(["--prompt", "hi", "--max-tokens", "8"], [ord(c) for c in "Paris."] + [0])
    assert run_component(engine, comp, host) is None  # result<_, string>: ok is None
    assert host.returned == "Paris."
    # the whole generation (prefill included) is one host-side loop: one call, no pass per token,
    # and a new context's pages come with it (generate-fresh): no allocate or attach-prefix call
    assert host.calls.count("forward.generate-fresh") == 1 and "forward.decode-step" not in host.calls
    assert not {"forward.generate", "kv.allocate", "kv.attach-prefix"} & set(host.calls)
    assert host.calls[-2:] == ["kv.release", "runtime.set-return"]


@pytest.mark.build
def test_component_reports_bad_arguments_as_err(component: tuple[Engine, Component]) -> None:
    engine, comp = component
    err = run_component(engine, comp, StubHost(["--max-tokens", "lots"], []))
    assert isinstance(err, str) and "--max-tokens" in err and "invalid int value" in err


@pytest.mark.build
def test_component_returns_help_text_for_help(component: tuple[Engine, Component]) -> None:
    engine, comp = component
    host = StubHost(["--max-tokens", "4", "--help"], [])
    assert run_component(engine, comp, host) is None
    assert host.returned is not None and "usage: text_completion" in host.returned
    assert "forward.run" not in host.calls  # nothing generated


@pytest.mark.build
def test_cache_hit_is_fast_and_cli_writes_output(built: tuple[Path, float], cache: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("PIE_CACHE_DIR", str(cache))
    path, first = built
    t0 = time.monotonic()
    again = build_inferlet(TEXT_COMPLETION, quiet=True)
    assert again == path and time.monotonic() - t0 < 0.5 < first
    out = tmp_path / "tc.wasm"
    assert main(["text_completion", "-o", str(out), "-q"]) == 0
    assert out.read_bytes() == path.read_bytes()
    assert resolve_inferlet("text_completion", quiet=True) == path
    assert resolve_inferlet(str(out)) == out


@pytest.mark.build
def test_syntax_error_gives_a_clear_error(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setenv("PIE_CACHE_DIR", str(cache))
    (tmp_path / "app.py").write_text("def main(args):\n    return (\n")
    with pytest.raises(BuildError, match="SyntaxError") as err:
        build_inferlet(tmp_path, quiet=True)
    assert "app.py" in str(err.value) and "Stack backtrace" not in str(err.value)
    t0 = time.monotonic()
    assert main([str(tmp_path), "-q"]) == 1  # the failure is cached: no second componentize-py run
    assert time.monotonic() - t0 < 0.5
    assert "SyntaxError: '(' was never closed" in capsys.readouterr().err


def test_bad_sources_are_named(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="needs an app.py"):
        build_inferlet(tmp_path)
    with pytest.raises(BuildError, match="standard: .*text_completion"):
        resolve_inferlet("no_such_inferlet")
    with pytest.raises(BuildError, match="no such component"):
        resolve_inferlet(tmp_path / "missing.wasm")


def test_entry_preloads_lazy_imports_but_not_local_modules(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(
        "import helper\nfrom . import x\ndef main(args):\n    import csv, xml.dom\n"
        "    from statistics import mean\n    from inferlet import Context\n    return ''\n"
    )
    (tmp_path / "helper.py").write_text("import json\n")
    entry = entry_source(source_files(tmp_path))
    assert "['csv', 'json', 'statistics', 'xml.dom']" in entry
    assert "helper" not in entry.split("make_world(app)")[1]
