/* Explorable figures (gradlab_book.interactive): the text alternative of the frame says
 * what the figure shows and where each slider stands, "<what it shows> (name = value,
 * ...).", and each slider announces its value label (aria-valuetext), not its index.
 * The figure's own script does this since gradlab_book.interactive learned it; figures
 * in notebooks whose outputs were made before (no data-alt on the <img>, or an older
 * wording) get it from here, so every figure of the site reads the same. This runs after
 * the figure's own script, on load and on every move, and writes the same text.
 */
(function () {
  function upgrade(root) {
    var img = root.querySelector('img.gradlab-frame');
    if (!img) { return; }
    var inputs = Array.prototype.slice.call(root.querySelectorAll('input[data-control]'));
    if (!img.hasAttribute('data-alt')) { img.setAttribute('data-alt', img.alt); }
    function describe() {
      var where = inputs.map(function (el) {
        var text = JSON.parse(el.getAttribute('data-labels'))[Number(el.value)];
        el.setAttribute('aria-valuetext', text);
        return el.getAttribute('aria-label') + ' = ' + text;
      });
      var alt = img.getAttribute('data-alt');
      img.alt = where.length ? alt.replace(/\.$/, '') + ' (' + where.join(', ') + ').' : alt;
    }
    inputs.forEach(function (el) { el.addEventListener('input', describe); });
    describe();
  }
  function upgradeAll() {
    document.querySelectorAll('.gradlab-explorable').forEach(upgrade);
  }
  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', upgradeAll);
  } else {
    upgradeAll();
  }
})();

/* MyST-NB folds a hide-input cell in a <summary aria-label="Toggle hidden content">
 * whose visible text is "Show code cell source": an accessible name that leaves out the
 * visible words fails WCAG 2.5.3 (label in name), so the visible text names it instead.
 */
(function () {
  function nameByText() {
    document.querySelectorAll('details > summary[aria-label="Toggle hidden content"]')
      .forEach(function (summary) { summary.removeAttribute('aria-label'); });
  }
  if (document.readyState === 'loading') {
    document.addEventListener('DOMContentLoaded', nameByText);
  } else {
    nameByText();
  }
})();
