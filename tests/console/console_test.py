#!/usr/bin/env python3
"""Drives ternfleet's web console in headless Chromium (selenium + Debian's chromedriver).

Run by coordinator/tests/cluster.rs (the_web_console_...), which starts a 3-node cluster and a
coordinator with an API key, and kills a node when this script asks for it:

  1. load `/`, enter the API key, wait for the cluster panel: every node row "up";
  2. send a chat message; count the updates of the assistant's message while it streams
     (a MutationObserver), wait for the end: the reply must have arrived in several pieces;
  3. screenshot; print "kill NODE" and wait for "killed" on stdin; measure how long until that
     node's row says "down"; screenshot again;
  4. print one JSON line of results.

Exit status 0 only when every check passed; the reason otherwise on stderr.
"""

import argparse
import json
import os
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def fail(msg):
    print(f"console test: {msg}", file=sys.stderr)
    sys.exit(1)


def wait_for(what, cond, timeout, step=0.05):
    t0 = time.monotonic()
    while True:
        v = cond()
        if v:
            return v, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            fail(f"{what}: not within {timeout} s")
        time.sleep(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--nodes", required=True, help="comma-separated node ids")
    ap.add_argument("--kill", required=True, help="the node to have killed")
    ap.add_argument("--down-within", type=float, required=True,
                    help="seconds allowed from the kill to the row saying down")
    ap.add_argument("--shots", required=True, help="directory for the screenshots")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--driver", default="/usr/bin/chromedriver")
    a = ap.parse_args()
    os.makedirs(a.shots, exist_ok=True)
    nodes = a.nodes.split(",")

    opts = Options()
    opts.binary_location = a.chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--disable-gpu", "--window-size=1400,860"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(a.driver), options=opts)
    driver.set_page_load_timeout(30)
    try:
        driver.get(a.url + "/")
        if "ternfleet" not in driver.title:
            fail(f"page title {driver.title!r}")
        key = driver.find_element(By.ID, "api-key")
        key.send_keys(a.key)
        driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)

        def health():
            # Read in one script: the table is rebuilt at every refresh (no stale elements).
            return driver.execute_script("""
                const out = {};
                for (const r of document.querySelectorAll('#nodes tbody tr')) {
                  const h = r.querySelector('.health');
                  if (h) out[r.dataset.node] = h.textContent;
                }
                return out;
            """)

        _, t_up = wait_for("every node up in the cluster panel",
                           lambda: all(health().get(n) == "up" for n in nodes), 20)

        # The chat: count the assistant message's updates while it streams.
        driver.execute_script("""
            window.__updates = 0;
            new MutationObserver(() => { window.__updates++; })
              .observe(document.getElementById('messages'),
                       {subtree: true, childList: true, characterData: true});
        """)
        # Greedy, so the reply (and the screenshot) is the model's most likely text.
        t = driver.find_element(By.ID, "temperature")
        t.clear()
        t.send_keys("0")
        m = driver.find_element(By.ID, "max-tokens")
        m.clear()
        m.send_keys("96")
        driver.find_element(By.ID, "prompt").send_keys("What is the capital of France?")
        driver.find_element(By.ID, "send").click()
        msg, t_chat = wait_for(
            "the assistant's reply",
            lambda: next((m for m in driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")
                          if m.get_attribute("data-done") == "1"), None), 60)
        text = msg.text
        if "error" in (msg.get_attribute("class") or ""):
            fail(f"the chat failed: {text}")
        updates = driver.execute_script("return window.__updates")
        if not text.strip():
            fail("the reply is empty")
        # The user message and the empty reply are two updates; streaming adds one per piece.
        if updates < 4:
            fail(f"the reply arrived in {updates - 2} update(s): not streamed")

        # Tokens/s and the heatmap's data are live after the chat.
        wait_for("tokens/s above 0", lambda: driver.find_element(By.ID, "tps").text not in ("–", "0.0"), 10)
        wait_for("a time to first token", lambda: driver.find_element(By.ID, "ttft").text != "–", 10)
        time.sleep(2.2)  # one routing refresh: the heatmap shows this chat's rows
        driver.save_screenshot(os.path.join(a.shots, "console.png"))

        print(f"kill {a.kill}", flush=True)
        if sys.stdin.readline().strip() != "killed":
            fail("no 'killed' from the test")
        _, t_down = wait_for(f"{a.kill} marked down",
                             lambda: health().get(a.kill) == "down", a.down_within + 10)
        if t_down > a.down_within:
            fail(f"{a.kill} shown down after {t_down:.2f} s, allowed {a.down_within} s")
        others = health()
        if any(others.get(n) != "up" for n in nodes if n != a.kill):
            fail(f"other nodes not up: {others}")
        time.sleep(1.2)
        driver.save_screenshot(os.path.join(a.shots, "console-node-down.png"))
        print(json.dumps({
            "nodes_up_after_s": round(t_up, 3),
            "reply_after_s": round(t_chat, 3),
            "reply_updates": updates - 2,
            "reply_chars": len(text),
            "down_shown_after_s": round(t_down, 3),
            "tokens_per_s": driver.find_element(By.ID, "tps").text,
            "ttft": driver.find_element(By.ID, "ttft").text,
        }), flush=True)
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
