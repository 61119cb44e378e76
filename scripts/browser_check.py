"""Open notebook 01 in JupyterLab in a real (headless) browser and check it works: called by
scripts/browser_check.sh, which says what it needs.

Starts `jupyter lab notebooks/` on 127.0.0.1 (a free port, a token, no browser) with the repo's
JupyterLab settings (notebooks/.jupyterlab: .py files open as Jupytext notebooks), opens
01_bf16_rounding.py by its URL in headless Chromium (Selenium, Debian's chromedriver), checks it
opened as a notebook, points run_dir at a temporary folder (one line typed into the parameters
cell), runs all cells from the Run menu, waits for every code cell to finish, checks the bf16
explorer widget rendered and answers a new value, and saves a screenshot and a log to
docs/browser_check/. Nothing is saved to the notebook (autosave off) and the repo's files are
checked unchanged. JupyterLab is shut down in every case. Exit code 0 only when every check
passed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NOTEBOOK = "01_bf16_rounding.py"
NEW_VALUE = "1000.5"  # typed into the explorer; its bf16 neighbours are 1000 and 1004

# Settings for this check only (a temporary user-settings folder): no autosave, so nothing is
# written back to the .py; every cell attached to the DOM; no news toast over the screenshot.
CHECK_USER_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
}


class CheckFailed(Exception):
    pass


class Log:
    def __init__(self):
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self.checks: list[tuple[str, bool, str]] = []

    def __call__(self, msg: str):
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.lines.append(line)

    def check(self, name: str, ok: bool, detail: str = ""):
        self.checks.append((name, ok, detail))
        self(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        if not ok:
            raise CheckFailed(f"{name}: {detail}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def command_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60).stdout.strip()
        return out.splitlines()[-1] if out else "?"
    except (OSError, subprocess.SubprocessError) as e:
        return f"? ({e})"


def repo_state() -> tuple[str, str]:
    """The notebooks folder as git sees it (tracked changes and untracked, not ignored, files) and the
    notebook's hash: both must be the same after the check."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "notebooks"],
                            check=False, cwd=ROOT, capture_output=True, text=True).stdout
    return status, hashlib.sha256((NOTEBOOKS / NOTEBOOK).read_bytes()).hexdigest()


def wait_for(what: str, fn, timeout: float, poll: float = 0.5):
    """Call fn until it returns something truthy; CheckFailed after timeout seconds."""
    end = time.monotonic() + timeout
    last_err = None
    while time.monotonic() < end:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - the DOM changes under us; try again
            last_err = e
        time.sleep(poll)
    raise CheckFailed(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last_err})" if last_err else ""))


class Lab:
    """jupyter lab in its own process group, with temporary runtime/config/data/settings folders."""

    def __init__(self, python: str, tmp: Path, log: Log, timeout: float):
        self.port, self.token = free_port(), secrets.token_hex(24)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.tmp = log, tmp
        settings = tmp / "user-settings"
        for name, value in CHECK_USER_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        env = dict(os.environ,
                   JUPYTER_CONFIG_DIR=str(tmp / "config"),   # no ~/.jupyter config
                   JUPYTER_DATA_DIR=str(tmp / "data"),       # no ~/.local kernelspecs: the venv's python3
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                   JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
                   JUPYTERLAB_SETTINGS_DIR=str(settings),
                   PYTHONUNBUFFERED="1")
        env.pop("JUPYTER_TOKEN", None)
        # The documented command (notebooks/README.md), run from the repo root, plus the headless options.
        cmd = [python, "-m", "jupyter", "lab", "notebooks/", "--LabApp.app_settings_dir=notebooks/.jupyterlab",
               "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}"]
        self.logfile = open(tmp / "jupyterlab.log", "w")  # noqa: SIM115 - open while the server runs
        log(f"starting: python {' '.join(cmd[1:6])} ... on port {self.port}")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.logfile, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_for("JupyterLab to answer /api/status", self._up, timeout)
        log(f"JupyterLab up at {self.url}")

    def _api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read()

    def _up(self):
        if self.proc.poll() is not None:
            raise CheckFailed(f"jupyter lab exited with {self.proc.returncode}; see its log below")
        try:
            return json.loads(self._api("/api/status"))
        except OSError:
            return None

    def shutdown(self):
        if self.proc.poll() is None:
            try:
                self._api("/api/shutdown", method="POST")
            except OSError as e:
                self.log(f"/api/shutdown failed ({e}); terminating")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.log("JupyterLab did not stop in 60s: SIGTERM to its process group")
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        # Kernels it started are in its process group; make sure none outlives it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.logfile.close()
        self.log(f"JupyterLab stopped (exit code {self.proc.returncode})")


def start_browser(chromium: str, chromedriver: str, tmp: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1100", "--no-first-run", "--no-default-browser-check",
                f"--user-data-dir={tmp / 'chromium-profile'}"):
        opts.add_argument(arg)
    service = Service(executable_path=chromedriver, log_output=str(tmp / "chromedriver.log"))
    return webdriver.Chrome(service=service, options=opts)


JS_STATE = """
const panel = document.querySelector('#jp-main-dock-panel .jp-NotebookPanel:not(.lm-mod-hidden)');
if (!panel) return null;
const uniq = [...panel.querySelectorAll('.jp-Notebook .jp-Cell')];
const code = uniq.filter(c => c.classList.contains('jp-CodeCell'));
const prompts = code.map(c => { const p = c.querySelector('.jp-InputArea-prompt'); return p ? p.textContent.trim() : ''; });
const ind = panel.querySelector('.jp-Notebook-ExecutionIndicator');
const errors = [...panel.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .map(e => e.textContent).filter(t => /Traceback|Error/.test(t)).map(t => t.slice(0, 400));
const kn = panel.querySelector('.jp-KernelName, .jp-Toolbar-kernelName');
return {kernel: kn ? kn.textContent.trim() : null, cells: uniq.length, code: code.length, prompts: prompts,
        status: ind ? ind.getAttribute('data-status') : null,
        editors: document.querySelectorAll('#jp-main-dock-panel .jp-FileEditor').length,
        tab: (document.querySelector('#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel') || {}).textContent,
        errors: errors};
"""


def widget_state(driver):
    return driver.execute_script("""
const w = document.querySelector('#jp-main-dock-panel .jp-NotebookPanel .widget-interact');
if (!w) return null;
const input = w.querySelector('.widget-text input');
const out = w.querySelector('.widget-output');
const table = out ? out.querySelector('table') : null;  // the DataFrame, without its <style>
return {input: input ? input.value : null, output: table ? table.textContent.replace(/\\s+/g, ' ').trim() : null};
""")


def run_check(args, log: Log, tmp: Path) -> None:
    import jupytext
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    nb = jupytext.read(NOTEBOOKS / NOTEBOOK)
    n_cells = len(nb.cells)
    n_code = sum(c.cell_type == "code" for c in nb.cells)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    log.check("notebook 01 parses (jupytext)", n_code > 0 and len(params) == 1,
              f"{n_cells} cells, {n_code} code, parameters cell: {params[0].source!r}" if params else "no parameters cell")
    log.check("smoke defaults to True", "smoke = True" in params[0].source.splitlines(), params[0].source.splitlines()[0])

    run_dir = tmp / "run_dir"
    lab = Lab(args.python, tmp, log, args.start_timeout)
    driver = None
    try:
        t = time.monotonic()
        driver = start_browser(args.chromium, args.chromedriver, tmp)
        log(f"browser started ({time.monotonic() - t:.1f}s): {driver.capabilities.get('browserVersion')}")
        driver.get(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}")

        t = time.monotonic()
        def opened():
            """The document's tab and its first content: notebook cells, or a text editor."""
            s = driver.execute_script(JS_STATE)
            if s and s["cells"] == n_cells:
                return s
            editors = driver.execute_script("return document.querySelectorAll('#jp-main-dock-panel .jp-FileEditor').length")
            return {"editors": editors, "tab": None, "cells": 0, "code": 0} if editors else None

        state = wait_for("the document to open", opened, args.open_timeout)
        log(f"opened in {time.monotonic() - t:.1f}s")
        log.check("opens as a notebook (Jupytext Notebook viewer), not a text editor",
                  state["editors"] == 0 and state["tab"] == NOTEBOOK and state["cells"] == n_cells
                  and state["code"] == n_code,
                  f"tab {state['tab']!r}, {state['cells']} cells ({state['code']} code), {state['editors']} file editors")
        state = wait_for("the kernel to start (idle)", lambda: (s := driver.execute_script(JS_STATE))["kernel"]
                         and "No Kernel" not in s["kernel"] and s["status"] == "idle" and s, args.open_timeout)
        log.check("kernel started", True, f"{state['kernel']!r}, {state['status']}, {time.monotonic() - t:.1f}s after opening")

        # run_dir -> a temporary folder: one line appended to the parameters cell, as a user would.
        param_cell = driver.execute_script("""
const cells = [...document.querySelectorAll('#jp-main-dock-panel .jp-NotebookPanel .jp-Cell')];
return cells.find(c => c.classList.contains('jp-CodeCell') && c.textContent.includes('run_dir ='));""")
        editor = param_cell.find_element(By.CSS_SELECTOR, ".cm-content")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", param_cell)
        editor.click()
        editor.send_keys(Keys.CONTROL, Keys.END)
        line = f'run_dir = "{run_dir}"  # browser check: outputs outside the repo'
        editor.send_keys(Keys.ENTER, line)
        typed = wait_for("the typed run_dir line", lambda: line in editor.text and editor.text, 10)
        editor.send_keys(Keys.ESCAPE)  # command mode
        log.check("parameters cell edited (run_dir outside the repo)", typed.rstrip().endswith(line), typed.replace("\n", " | "))

        # Run -> Run All Cells, from the menu bar.
        t_run = time.monotonic()
        menus = driver.find_elements(By.CSS_SELECTOR, "#jp-menu-panel .lm-MenuBar-item")
        run_menu = next((m for m in menus if m.text.strip() == "Run"), None)
        if run_menu is None:
            raise CheckFailed(f"no Run menu among {[m.text for m in menus]}")
        run_menu.click()
        item = wait_for("Run All Cells in the Run menu", lambda: next(
            (i for i in driver.find_elements(By.CSS_SELECTOR, ".lm-Menu .lm-Menu-item")
             if i.text.strip().startswith("Run All Cells")), None), 10)
        log(f"menu item: {item.text.strip()!r} ({item.get_attribute('data-command')})")
        item.click()
        log("Run > Run All Cells clicked")

        def finished():
            s = driver.execute_script(JS_STATE)
            if s["errors"]:
                raise CheckFailed(f"error output: {s['errors'][0]}")
            done = all(p.startswith("[") and p.strip("[]:").isdigit() for p in s["prompts"])
            return s if (done and s["status"] == "idle") else None

        last_report = [0.0]

        def finished_with_progress():
            s = finished()
            if time.monotonic() - last_report[0] > 15:
                last_report[0] = time.monotonic()
                p = driver.execute_script(JS_STATE)["prompts"]
                log(f"  running: prompts {' '.join(p)}")
            return s

        state = wait_for("every code cell to run, kernel idle", finished_with_progress, args.run_timeout, poll=1)
        t_ran = time.monotonic() - t_run
        log.check("all cells ran without error", True,
                  f"{t_ran:.1f}s; prompts {' '.join(state['prompts'])}")
        csv = run_dir / "metrics" / "batch_variance.csv"
        log.check("outputs went to the temporary run_dir", csv.exists(), str(csv))

        # The bf16 explorer: rendered, and it answers a new value.
        w = wait_for("the bf16 explorer widget (.widget-interact with an output)",
                     lambda: (s := widget_state(driver)) and s["output"] and s, 60)
        log.check("bf16 explorer widget rendered", w["input"] is not None and "0.1" in w["output"],
                  f"input {w['input']!r}, output {w['output'][:160]!r}")
        before = w["output"]
        box = driver.find_element(By.CSS_SELECTOR, "#jp-main-dock-panel .jp-NotebookPanel .widget-interact .widget-text input")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", box)
        t = time.monotonic()
        box.click()
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(NEW_VALUE, Keys.ENTER)
        w = wait_for("the explorer output to change", lambda: (s := widget_state(driver)) and s["output"]
                     and s["output"] != before and NEW_VALUE in s["output"] and s, 60)
        log.check("bf16 explorer responds to a new input", "1004" in w["output"],
                  f"{time.monotonic() - t:.1f}s; input {w['input']!r}, output {w['output'][:160]!r}")

        # Screenshot: the explorer in view.
        driver.execute_script("""
const w = document.querySelector('#jp-main-dock-panel .jp-NotebookPanel .widget-interact');
w.closest('.jp-Cell').scrollIntoView({block: 'end'});""")
        time.sleep(1)
        args.out.mkdir(parents=True, exist_ok=True)
        shot = args.out / "notebook01.png"
        log.check("screenshot saved", driver.save_screenshot(str(shot)), str(shot.relative_to(ROOT)))
        (args.out / "failure.png").unlink(missing_ok=True)
    except BaseException:
        if driver is not None:
            try:
                args.out.mkdir(parents=True, exist_ok=True)
                driver.save_screenshot(str(args.out / "failure.png"))
                log(f"screenshot of the failure: {(args.out / 'failure.png').relative_to(ROOT)}")
            except Exception as e:  # noqa: BLE001
                log(f"no failure screenshot: {e}")
        raise
    finally:
        if driver is not None:
            try:
                driver.quit()
            except Exception as e:  # noqa: BLE001
                log(f"browser quit failed: {e}")
        lab.shutdown()


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=sys.executable, help="the venv's python (runs jupyter lab and the kernel)")
    p.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    p.add_argument("--chromedriver", default=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "browser_check")
    p.add_argument("--start-timeout", type=float, default=120, help="seconds for JupyterLab to start")
    p.add_argument("--open-timeout", type=float, default=180, help="seconds to open the notebook and start its kernel")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds for Run All Cells")
    args = p.parse_args()

    log = Log()
    started = datetime.now(UTC)
    signal.signal(signal.SIGTERM, _interrupted)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False, cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    versions = {
        "python": platform.python_version(),
        **{d: version(d) for d in ("jupyterlab", "jupyter_server", "jupytext", "ipykernel", "ipywidgets",
                                   "jupyterlab_widgets", "selenium")},
        "chromium": command_version([args.chromium, "--version"]),
        "chromedriver": command_version([args.chromedriver, "--version"]),
    }
    log(f"browser check of notebooks/{NOTEBOOK}, git {sha}{' (with local changes)' if dirty else ''}")
    log("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    ckpt = NOTEBOOKS / ".ipynb_checkpoints"
    had_ckpt = ckpt.exists()
    before = repo_state()
    ok, failure = False, ""
    tmp = Path(tempfile.mkdtemp(prefix="browser_check."))
    try:
        run_check(args, log, tmp)
        after = repo_state()
        log.check("notebooks/ unchanged (nothing saved back to the .py, no new files)", after == before,
                  "" if after == before else f"git status before {before[0]!r}, after {after[0]!r}")
        ok = True
    except (CheckFailed, KeyboardInterrupt) as e:
        failure = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        failure = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        if not had_ckpt and ckpt.exists():
            shutil.rmtree(ckpt, ignore_errors=True)
        total = time.monotonic() - log.t0
        if failure:
            log(f"FAILED: {failure}")
            lablog = tmp / "jupyterlab.log"
            if lablog.exists():
                print("---- jupyter lab log (last 60 lines) ----\n" + "\n".join(lablog.read_text().splitlines()[-60:]))
        log(f"{'OK' if ok else 'FAILED'} in {total:.0f}s")
        args.out.mkdir(parents=True, exist_ok=True)
        summary = [
            f"# scripts/browser_check.sh: notebooks/{NOTEBOOK} in JupyterLab in headless Chromium",
            f"result: {'OK' if ok else 'FAILED'}",
            f"date: {started.strftime('%Y-%m-%d %H:%M:%S UTC')}",
            f"git: {sha}{' (with local changes)' if dirty else ''}",
            f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            f"total: {total:.0f}s",
            "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
            "checks:",
            *[f"  {'PASS' if c_ok else 'FAIL'} {name}" + (f": {detail}" if detail else "") for name, c_ok, detail in log.checks],
            *([f"failure: {failure.splitlines()[0]}"] if failure else []),
            "log:",
            *[f"  {line}" for line in log.lines],
        ]
        (args.out / "log.txt").write_text("\n".join(summary) + "\n")
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
