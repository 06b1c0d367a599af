"use strict";
// Shows the failed-login note; the form itself needs no script.
if (new URLSearchParams(window.location.search).get("failed") === "1") {
  document.getElementById("failed").hidden = false;
}
