// The page as the agent reads it: a compact walk of the DOM (clawrl/envs/gui/view.py turns it
// into lines). Each element that can be acted on or says something (buttons, links, fields,
// switches, options, headings, list items, text, alerts) gets a stable id: its data-key (set
// by the app) or its path in the DOM, mapped to a number the first time it is seen, written
// back as data-gid so that the environment can find it again. Content behind a modal dialog
// (inert) is marked covered; inside <label> (it names its control) or hidden it is left out;
// only elements that intersect the viewport are listed, the rest are counted above and below.
() => {
  const ids = window.__gids || (window.__gids = { map: new Map(), next: 1 });
  const vw = window.innerWidth, vh = window.innerHeight;
  const squash = (s) => (s || "").replace(/\s+/g, " ").trim();
  const ownText = (el) => squash([...el.childNodes].filter((n) => n.nodeType === 3).map((n) => n.textContent).join(" "));
  const ACTIVE = new Set(["button", "link", "textbox", "checkbox", "radio", "switch", "combobox",
    "option", "menuitem", "slider", "tab"]);
  function roleOf(el) {
    const r = el.getAttribute("role");
    if (r && r !== "presentation" && r !== "none") return ACTIVE.has(r) || ["alert", "status", "dialog"].includes(r) ? r : ownText(el) ? r : null;
    const t = el.tagName;
    if (t === "A" && el.hasAttribute("href")) return "link";
    if (t === "INPUT") {
      const ty = el.type;
      if (ty === "hidden") return null;
      return { checkbox: "checkbox", radio: "radio", range: "slider", submit: "button", button: "button" }[ty] || "textbox";
    }
    if (t === "BUTTON") return "button";
    if (t === "SELECT") return "combobox";
    if (t === "TEXTAREA") return "textbox";
    if (/^H[1-6]$/.test(t)) return "heading";
    if (ownText(el)) return t === "LI" ? "listitem" : "text";
    return null;
  }
  function path(el) {
    const parts = [];
    for (let e = el; e && e !== document.body; e = e.parentElement) {
      let i = 0;
      for (let s = e; (s = s.previousElementSibling);) i += s.tagName === e.tagName;
      parts.push(e.tagName + i);
    }
    return parts.reverse().join("/");
  }
  function nameOf(el, role) {
    const aria = el.getAttribute("aria-label");
    if (aria) return squash(aria);
    if (el.labels && el.labels.length) return squash(el.labels[0].textContent);
    if (role === "listitem" || role === "text") return ownText(el);
    if (role === "textbox") return squash(el.placeholder);
    return squash(el.textContent);
  }
  function stateOf(el, role) {
    const out = [];
    const checked = el.getAttribute("aria-checked") ?? (el.type === "checkbox" || el.type === "radio" ? String(el.checked) : null);
    if (checked !== null) out.push(checked === "true" ? "on" : "off");
    const exp = el.getAttribute("aria-expanded");
    if (exp !== null) out.push(exp === "true" ? "expanded" : "collapsed");
    if (el.getAttribute("aria-selected") === "true") out.push("selected");
    if (el.disabled) out.push("disabled");
    if (el.getAttribute("aria-invalid") === "true") out.push("invalid");
    if (document.activeElement === el && role === "textbox") out.push("focused");
    return out;
  }
  const items = [];
  let above = 0, below = 0;
  for (const el of document.body.querySelectorAll("*")) {
    if (el.closest("[aria-hidden='true'],label,script,style,template")) continue;
    const role = roleOf(el);
    if (!role) continue;
    // the text of a button, link or option is its name, not a line of its own
    if (!ACTIVE.has(role) && el.parentElement.closest("button,a,[role=option],[role=menuitem],[role=switch],[role=combobox]")) continue;
    const r = el.getBoundingClientRect();
    if (r.width < 1 || r.height < 1) continue;
    const cs = getComputedStyle(el);
    if (cs.visibility === "hidden" || cs.display === "none") continue;
    if (r.bottom <= 0) { above++; continue; }
    if (r.top >= vh) { below++; continue; }
    if (r.right <= 0 || r.left >= vw) continue;
    const key = el.dataset.key || path(el);
    if (!ids.map.has(key)) ids.map.set(key, ids.next++);
    const id = ids.map.get(key);
    el.dataset.gid = id;
    let value = null;
    if (role === "textbox") value = el.value;
    else if (role === "combobox") value = el.tagName === "SELECT" ? squash(el.selectedOptions[0]?.textContent) : squash(el.textContent);
    items.push({ id, role, name: nameOf(el, role), value, states: stateOf(el, role),
      covered: !!el.closest("[inert]"),
      level: /^H[1-6]$/.test(el.tagName) ? +el.tagName[1] : null,
      box: [Math.round(Math.max(0, r.left)), Math.round(Math.max(0, r.top)),
            Math.round(Math.min(vw, r.right)), Math.round(Math.min(vh, r.bottom))] });
  }
  return { title: document.title, width: vw, height: vh, scroll: [Math.round(scrollX), Math.round(scrollY)],
           above, below, items };
}
