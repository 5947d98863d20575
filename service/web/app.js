// The tonearm demo page: plain JavaScript against the service's own /v1 API (docs/service.md).
"use strict";

const LANGUAGES = {
  eng: "English", fra: "Français", deu: "Deutsch", spa: "Español",
  nld: "Nederlands", cat: "Català", jpn: "日本語", zho: "中文",
};
// Query groups: one caption and its translations (the synthetic corpus' vocabulary).
const EXAMPLES = [
  {
    eng: "A songbird sings nearby twice, with pauses in between.",
    fra: "Un oiseau chante tout près deux fois, avec des pauses.",
    deu: "Ein Singvogel singt ganz in der Nähe zweimal, mit Pausen dazwischen.",
    spa: "Un pájaro canta muy cerca dos veces, con pausas entre medias.",
    nld: "Een zangvogel zingt dichtbij twee keer, met pauzes ertussen.",
    cat: "Un ocell canta molt a prop dues vegades, amb pauses entremig.",
    jpn: "すぐ近くで小鳥が鳴く音が2回、間をおいて聞こえる。",
    zho: "一只小鸟在近处啼鸣，重复了两次，中间有停顿。",
  },
  {
    eng: "A telephone rings with a deep sound, then an alarm beeps softly and rapidly nearby.",
    fra: "Un téléphone sonne dans les graves, puis une alarme bipe faiblement et vite tout près.",
    deu: "Ein Telefon läutet in tiefer Tonlage, dann piept ein Alarm leise und zügig ganz in der Nähe.",
    spa: "Un teléfono timbra con un sonido grave, luego una alarma pita débilmente y deprisa muy cerca.",
    nld: "Een telefoon rinkelt met een laag geluid, dan piept een alarm zachtjes en snel dichtbij.",
    cat: "Un telèfon sona amb un so greu, després una alarma xiscla suaument i de pressa molt a prop.",
    jpn: "電話のベルが太い音で鳴り響いた後、すぐ近くでアラームがかすかに、せわしなくピピッと鳴る。",
    zho: "一部电话以低沉的声音铃铃作响，然后警报器在近处小声、快速地嘀嘀作响。",
  },
];

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function setStatus(id, text, isError = false) {
  const node = $(id);
  node.textContent = text;
  node.classList.toggle("error", isError);
}

async function api(path, options = {}) {
  const response = await fetch(path, options);
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    // problem+json (RFC 9457): the detail says what is wrong
    throw new Error(body.detail || body.title || `HTTP ${response.status}`);
  }
  return body;
}

function showExamples() {
  // the example queries of the chosen language (every language has the same query groups)
  const code = $("lang").value;
  const box = $("examples");
  box.replaceChildren(el("span", { class: "examples-title" }, "Examples:"));
  EXAMPLES.forEach((group, index) => {
    const button = el("button", { type: "button", class: "example", lang: code }, group[code]);
    button.addEventListener("click", () => {
      $("query").value = group[code];
      $("group").value = String(index);
      search();
    });
    box.append(button);
  });
}

function setupLanguages() {
  for (const [code, name] of Object.entries(LANGUAGES)) {
    $("lang").append(el("option", { value: code }, `${name} (${code})`));
  }
  EXAMPLES.forEach((group, index) => $("group").append(el("option", { value: String(index) }, group.eng)));
  $("lang").addEventListener("change", showExamples);
  showExamples();
}

function renderHits(hits) {
  const list = $("hits");
  list.replaceChildren();
  for (const hit of hits) {
    const item = el("li");
    const head = el("div", { class: "hit-head" });
    head.append(el("span", { class: "hit-id" }, hit.id), el("span", { class: "score" }, `score ${hit.score.toFixed(3)}`));
    item.append(head);
    const captions = hit.captions || {};
    const lang = $("lang").value;
    const caption = (captions[lang] || captions.eng || [])[0];
    if (caption) item.append(el("p", { class: "caption", lang: captions[lang] ? lang : "eng" }, caption));
    const audio = el("audio", { controls: "", preload: "metadata", src: `/v1/audio/${idPath(hit.id)}`,
                                "aria-label": `Play clip ${hit.id}` });
    const more = el("button", { type: "button", class: "more-like-this", "aria-label": `More like ${hit.id}` },
                    "More like this");
    more.addEventListener("click", () => moreLikeThis(hit.id));
    item.append(audio, more);
    list.append(item);
  }
}

// An id in a URL path: each `/`-separated segment percent-encoded, the slashes kept (ids of clips in
// subfolders hold `/`; the routes take {id:path}, and proxies may refuse an encoded slash, %2F).
function idPath(id) {
  return id.split("/").map(encodeURIComponent).join("/");
}

async function moreLikeThis(id) {
  // the catalogue's clips by audio–audio cosine (GET /v1/search/similar/{id}), the clip itself excluded
  setStatus("search-status", `Looking for clips like ${id}…`);
  try {
    const body = await api(`/v1/search/similar/${idPath(id)}?k=10`);
    renderHits(body.hits);
    setStatus("search-status", `${body.hits.length} clips like ${id}.`);
  } catch (err) {
    setStatus("search-status", `Search failed: ${err.message}`, true);
  }
}

async function search(event) {
  if (event) event.preventDefault();
  const query = $("query").value.trim();
  if (!query) { setStatus("search-status", "Type a query first.", true); return; }
  setStatus("search-status", "Searching…");
  try {
    const body = await api("/v1/search/text", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ query, lang: $("lang").value, k: 10, include_captions: true }),
    });
    $("bundle").textContent = `Bundle ${body.bundle_id}.`;
    renderHits(body.hits);
    setStatus("search-status", `${body.hits.length} clips for “${query}”.`);
  } catch (err) {
    setStatus("search-status", `Search failed: ${err.message}`, true);
  }
}

function clock(seconds) {
  const m = Math.floor(seconds / 60), s = seconds - 60 * m;
  return `${m}:${s.toFixed(1).padStart(4, "0")}`;
}

function renderMoments(hits) {
  // one item per moment: a timeline of its recording (every hit in it marked, this one highlighted)
  // and a player that starts at the moment
  const list = $("moments");
  list.replaceChildren();
  hits.forEach((hit, index) => {
    const item = el("li");
    const head = el("div", { class: "hit-head" });
    head.append(el("span", { class: "hit-id" }, `${hit.id} · ${clock(hit.start)}–${clock(hit.end)}`),
                el("span", { class: "score" }, `score ${hit.score.toFixed(3)}`));
    const timeline = el("div", { class: "timeline", role: "img",
                                 "aria-label": `Moment ${clock(hit.start)} to ${clock(hit.end)} of ${hit.id}` });
    const audio = el("audio", { controls: "", preload: "metadata", src: `/v1/audio/${encodeURIComponent(hit.id)}`,
                                "aria-label": `Play ${hit.id} from ${clock(hit.start)}` });
    audio.addEventListener("loadedmetadata", () => {
      const total = audio.duration || hit.end;
      for (const other of hits.filter((h) => h.id === hit.id)) {
        const mark = el("span", { class: other === hit ? "mark current" : "mark" });
        mark.style.left = `${(100 * other.start) / total}%`;
        mark.style.width = `${Math.max(0.5, (100 * (other.end - other.start)) / total)}%`;
        timeline.append(mark);
      }
      audio.currentTime = hit.start;
    });
    const play = el("button", { type: "button", class: "more-like-this", "data-moment": String(index) },
                    `Play from ${clock(hit.start)}`);
    play.addEventListener("click", () => { audio.currentTime = hit.start; audio.play(); });
    item.append(head, timeline, audio, play);
    list.append(item);
  });
}

async function findMoments(event) {
  if (event) event.preventDefault();
  const query = $("moment-query").value.trim();
  if (!query) { setStatus("moments-status", "Type a query first.", true); return; }
  setStatus("moments-status", "Searching the long recordings…");
  try {
    const body = await api("/v1/search/moments", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ query, lang: $("lang").value, k: 5 }),
    });
    renderMoments(body.hits);
    // which scorer answered (the response's `scorer`): the bundle's trained moment head, or the sliding windows
    const scorer = body.scorer === "head" ? "the trained moment head" : "the sliding windows";
    $("moments").dataset.scorer = body.scorer;
    setStatus("moments-status",
              `${body.hits.length} moment${body.hits.length === 1 ? "" : "s"} for “${query}”, scored by ${scorer} (windows of ${body.window_seconds} s every ${body.hop_seconds} s).`);
  } catch (err) {
    setStatus("moments-status", `Moment search failed: ${err.message}`, true);
  }
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== null) node.textContent = text;
  return node;
}

function renderChart(body) {
  const rows = Object.entries(body.languages);
  const chart = $("rank-chart");
  // about a phone's width, so that the labels keep their size there rather than shrink
  const barHeight = 22, left = 86, width = 190, top = 8;
  const maxRank = Math.max(10, ...rows.map(([, d]) => d.target_rank || 0));  // rank 1 stays a short bar
  const totalWidth = width + left + 60, totalHeight = top + rows.length * (barHeight + 6) + 8;
  chart.setAttribute("viewBox", `0 0 ${totalWidth} ${totalHeight}`);
  chart.setAttribute("width", String(totalWidth));  // intrinsic size: CSS scales it, keeping the ratio
  chart.setAttribute("height", String(totalHeight));
  chart.replaceChildren();
  rows.forEach(([code, diagnosis], i) => {
    const y = top + i * (barHeight + 6);
    const rank = diagnosis.target_rank || 0;
    const w = Math.max(2, (rank / maxRank) * width);
    chart.append(svg("text", { x: 0, y: y + barHeight * 0.7 }, LANGUAGES[code] || code));
    chart.append(svg("rect", { x: left, y, width: w, height: barHeight, rx: 3 }));
    chart.append(svg("text", { x: left + w + 6, y: y + barHeight * 0.7 }, `rank ${rank}`));
  });
  const mrv = body.mrv === null ? "n/a" : body.mrv.toFixed(2);
  $("rank-caption").textContent =
    `Rank of clip ${body.target_id} for the same caption in each language (shorter is better). MRV ${mrv}.`;
  const tbody = $("rank-table").querySelector("tbody");
  tbody.replaceChildren();
  for (const [code, diagnosis] of rows) {
    const tr = el("tr");
    tr.append(el("th", { scope: "row" }, LANGUAGES[code] || code), el("td", {}, String(diagnosis.target_rank)),
              el("td", {}, diagnosis.hits.length ? diagnosis.hits[0].id : "—"));
    tbody.append(tr);
  }
  $("consistency-figure").hidden = false;
}

async function checkConsistency(event) {
  event.preventDefault();
  const group = EXAMPLES[Number($("group").value)];
  let target = $("target").value.trim();
  setStatus("consistency-status", "Checking…");
  try {
    if (!target) {  // default target: the first English hit of the example
      const first = await api("/v1/search/text", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ query: group.eng, lang: "eng", k: 1 }),
      });
      target = first.hits.length ? first.hits[0].id : null;
    }
    const body = await api("/v1/diagnostics/consistency", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ captions: group, target_id: target, k: 5 }),
    });
    renderChart(body);
    setStatus("consistency-status", `Target ${body.target_id}: MRV ${body.mrv === null ? "n/a" : body.mrv.toFixed(2)}.`);
  } catch (err) {
    setStatus("consistency-status", `Consistency check failed: ${err.message}`, true);
  }
}

async function findCaptions(event) {
  event.preventDefault();
  const file = $("audio-file").files[0];
  if (!file) { setStatus("upload-status", "Choose an audio file first.", true); return; }
  setStatus("upload-status", "Uploading…");
  const form = new FormData();
  form.append("file", file);
  try {
    const body = await api("/v1/search/audio?k=2", { method: "POST", body: form });
    const list = $("captions");
    list.replaceChildren();
    for (const hit of body.hits) {
      const item = el("li", { lang: hit.lang });
      item.append(el("strong", {}, `${LANGUAGES[hit.lang] || hit.lang}: `), document.createTextNode(hit.text),
                  el("span", { class: "score" }, ` (${hit.score.toFixed(3)}, clip ${hit.clip_id})`));
      list.append(item);
    }
    setStatus("upload-status", `${body.hits.length} captions for a ${body.duration_seconds.toFixed(1)} s ${body.format} file.`);
  } catch (err) {
    setStatus("upload-status", `Caption search failed: ${err.message}`, true);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  setupLanguages();
  $("search-form").addEventListener("submit", search);
  $("moments-form").addEventListener("submit", findMoments);
  $("consistency-form").addEventListener("submit", checkConsistency);
  $("upload-form").addEventListener("submit", findCaptions);
});
