// The generated web applications (clawrl/envs/gui/apps.py draws their specs): one page per
// episode, rendered from window.SPEC. The application's own state is window.app.state; the
// environment's checker reads it after the episode, never what the agent says.
// Every state change re-renders the page; elements keep their ids across renders through
// data-key (the walker in walk.js maps keys to ids).
(function () {
  const S = window.SPEC;
  const app = (window.app = { state: null });
  const root = document.getElementById("root");
  let open = null; // the key of the open dropdown or menu

  function h(tag, props, ...kids) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "text") el.textContent = v;
      else if (k === "value") el.value = v;
      else if (k === "key") el.dataset.key = v;
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const kid of kids.flat()) if (kid !== null && kid !== undefined && kid !== false) el.append(kid);
    return el;
  }

  function render() {
    const focused = document.activeElement && document.activeElement.dataset.key;
    root.className = "layout-" + S.layout;
    root.replaceChildren(VIEWS[S.template]());
    if (focused) {
      const el = root.querySelector(`[data-key="${CSS.escape(focused)}"]`);
      if (el) el.focus();
    }
  }

  function field(id, label, control) {
    return h("div", { class: "row", key: "row:" + id }, h("label", { for: id, text: label }), control);
  }

  function dropdown(key, label, options, value, pick) {
    const isOpen = open === key;
    return h("div", { class: "dd" },
      h("button", { type: "button", id: "c-" + key, role: "combobox", "aria-haspopup": "listbox",
        "aria-expanded": String(isOpen), "aria-label": label, key: "dd:" + key,
        onclick: () => { open = isOpen ? null : key; render(); } }, value || "Choose…"),
      isOpen && h("ul", { role: "listbox", "aria-label": label, class: "pop" },
        options.map((o) => h("li", { role: "option", "aria-selected": String(o === value),
          key: `opt:${key}:${o}`, onclick: () => { open = null; pick(o); render(); } }, o))));
  }

  const VIEWS = {
    settings() {
      const st = app.state;
      const set = (key, v) => {
        st.values[key] = v;
        if (S.save) st.status = "Unsaved changes";
        else st.saved = { ...st.values };
        render();
      };
      const rows = S.controls.map((c) => field("c-" + c.key, c.label, c.type === "toggle"
        ? h("button", { type: "button", id: "c-" + c.key, role: "switch", class: "switch",
            "aria-checked": String(st.values[c.key]), "aria-label": c.label, key: "sw:" + c.key,
            onclick: () => set(c.key, !st.values[c.key]) }, st.values[c.key] ? "On" : "Off")
        : dropdown(c.key, c.label, c.options, st.values[c.key], (v) => set(c.key, v))));
      return h("main", {}, h("h1", { text: S.title }), h("div", { class: "grid" }, rows),
        S.save && h("button", { type: "button", key: "save", onclick: () => {
          st.saved = { ...st.values }; st.status = "Settings saved"; render(); } }, S.save),
        st.status && h("p", { role: "status", key: "status" }, st.status));
    },

    form() {
      const st = app.state;
      if (st.submitted) return h("main", {}, h("h1", { text: S.title }),
        h("p", { role: "status", key: "sent" }, S.thanks));
      const controls = S.fields.map((f) => [field("f-" + f.key, f.label + (f.required ? " *" : ""),
        f.type === "choice"
          ? dropdown(f.key, f.label, f.options, st.values[f.key], (v) => { st.values[f.key] = v; })
          : h("input", { id: "f-" + f.key, type: f.type === "email" ? "email" : "text",
              "aria-label": f.label, key: "f:" + f.key, value: st.values[f.key],
              "aria-invalid": st.errors[f.key] ? "true" : null,
              oninput: (e) => { st.values[f.key] = e.target.value; } })),
        st.errors[f.key] && h("p", { role: "alert", key: "err:" + f.key }, st.errors[f.key])]);
      return h("main", {}, h("h1", { text: S.title }),
        h("form", { novalidate: true, onsubmit: (e) => { e.preventDefault(); submit(); } },
          h("div", { class: "grid" }, controls.flat()),
          h("button", { type: "submit", key: "submit" }, S.submit)));
    },

    menu() {
      const st = app.state;
      const go = (page) => { st.page = page; st.visits.push(page); open = null; render(); };
      const nav = S.menus.map((m) => m.items
        ? h("div", { class: "menu" },
            h("button", { type: "button", "aria-haspopup": "menu", key: "menu:" + m.label,
              "aria-expanded": String(open === m.label),
              onclick: () => { open = open === m.label ? null : m.label; render(); } }, m.label),
            open === m.label && h("div", { role: "menu", "aria-label": m.label, class: "pop" },
              m.items.map((it) => h("button", { type: "button", role: "menuitem",
                key: "item:" + it.page, onclick: () => go(it.page) }, it.label))))
        : h("a", { href: "#" + m.page, key: "link:" + m.page,
            onclick: (e) => { e.preventDefault(); go(m.page); } }, m.label));
      const page = S.pages[st.page];
      return h("div", {}, h("header", {}, h("strong", { text: S.title }),
        h("nav", { "aria-label": "Main" }, nav)),
        h("main", {}, h("h1", { text: page.title }), h("p", { text: page.text })));
    },

    basket() {
      const st = app.state;
      const name = Object.fromEntries(S.products.map((p) => [p.key, p.name]));
      const change = (key, n) => {
        st.basket[key] = (st.basket[key] || 0) + n;
        if (st.basket[key] <= 0 || n === 0) delete st.basket[key];
        render();
      };
      const shop = S.products.map((p) => h("li", { key: "p:" + p.key }, `${p.name} ${p.price}`,
        h("button", { type: "button", "aria-label": `Add ${p.name}`, key: "add:" + p.key,
          onclick: () => change(p.key, 1) }, "Add")));
      const lines = Object.entries(st.basket).map(([k, q]) => h("li", { key: "b:" + k },
        `${name[k]} × ${q}`, h("button", { type: "button", "aria-label": `Remove ${name[k]}`,
          key: "rm:" + k, onclick: () => change(k, 0) }, "Remove")));
      const count = Object.values(st.basket).reduce((a, b) => a + b, 0);
      return h("main", {}, h("h1", { text: S.title }),
        h("section", { "aria-label": "Products" }, h("ul", { class: "grid" }, shop)),
        h("section", { "aria-label": "Basket", key: "basket" }, h("h2", { text: "Basket" }),
          lines.length ? h("ul", {}, lines) : h("p", { text: "Your basket is empty." }),
          h("p", { role: "status", key: "count" }, `${count} item${count === 1 ? "" : "s"}`)));
    },

    dialog() {
      const st = app.state;
      const d = st.dialog;
      const close = () => { st.log.push("cancel"); st.dialog = null; render(); };
      const rows = st.items.map((it) => h("li", { key: "row:" + it }, it,
        h("button", { type: "button", "aria-label": `Rename ${it}`, key: "ren:" + it,
          onclick: () => { st.dialog = { kind: "rename", item: it, draft: it }; st.log.push("open"); render(); } }, "Rename"),
        h("button", { type: "button", "aria-label": `Delete ${it}`, key: "del:" + it,
          onclick: () => { st.dialog = { kind: "delete", item: it }; st.log.push("open"); render(); } }, "Delete")));
      const act = () => {
        const i = st.items.indexOf(d.item);
        if (d.kind === "delete") st.items.splice(i, 1);
        else if (d.draft.trim()) st.items[i] = d.draft.trim();
        else { d.error = "The name cannot be empty"; render(); return; }
        st.log.push(d.kind); st.dialog = null; render();
      };
      const box = d && h("form", { role: "dialog", "aria-modal": "true", class: "dialog", key: "dlg",
          "aria-label": d.kind === "delete" ? `Delete ${d.item}?` : `Rename ${d.item}`,
          onsubmit: (e) => { e.preventDefault(); act(); } },
        h("h2", { text: d.kind === "delete" ? `Delete ${d.item}?` : `Rename ${d.item}` }),
        d.kind === "delete" ? h("p", { text: S.warning })
          : field("new-name", "New name", h("input", { id: "new-name", key: "dlg:name", value: d.draft,
              "aria-label": "New name", oninput: (e) => { d.draft = e.target.value; } })),
        d.error && h("p", { role: "alert", key: "dlg:err" }, d.error),
        h("button", { type: "button", key: "dlg:cancel", onclick: close }, S.cancel),
        h("button", { type: "submit", key: "dlg:ok" }, d.kind === "delete" ? S.confirm : "Save"));
      return h("div", {}, h("main", { inert: !!d }, h("h1", { text: S.title }), h("ul", { class: "grid" }, rows)),
        d && h("div", { class: "backdrop", key: "backdrop" }), box);
    },
  };

  function submit() {
    const st = app.state;
    st.errors = {};
    for (const f of S.fields) {
      const v = String(st.values[f.key] || "").trim();
      const low = f.label.toLowerCase();
      if (f.required && !v) st.errors[f.key] = f.type === "choice" ? `Please choose a ${low}` : `Please enter your ${low}`;
      else if (v && f.type === "number" && !(/^\d+$/.test(v) && +v >= f.min && +v <= f.max))
        st.errors[f.key] = `${f.label} must be a whole number from ${f.min} to ${f.max}`;
      else if (v && f.type === "email" && !/^[^@\s]+@[^@\s]+\.[^@\s]+$/.test(v))
        st.errors[f.key] = "Enter an email address like ada@example.com";
    }
    st.attempts += 1;
    if (!Object.keys(st.errors).length)
      st.submitted = Object.fromEntries(S.fields.map((f) => [f.key, String(st.values[f.key] || "").trim()]));
    render();
  }

  app.state = JSON.parse(JSON.stringify(S.state));
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    if (open) { open = null; render(); } else if (app.state.dialog) { app.state.log.push("cancel"); app.state.dialog = null; render(); }
  });
  render();
})();
