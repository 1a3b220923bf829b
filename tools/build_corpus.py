"""Rebuild data/corpus/*.jsonl from two public-domain Debian packages (provenance: data/README.md).

This is the one-off script that made the shipped corpus; nothing at training time runs it. It reads the files that
two Debian packages install and writes one JSON object per document, `{"text", "title", "source"}`:

  dict-devil      /usr/share/dictd/devil.dict.dz (+ devil.index)      The Devil's Dictionary (Bierce, 1911)
                  -> devils_dictionary.jsonl, one document per dictionary entry (plus the preface)
  sword-text-web  /usr/share/sword/modules/texts/ztext/engWEB2015eb/  World English Bible (public domain)
                  -> world_english_bible_nt.jsonl, one document per chapter of the New Testament

Reproduce (Debian bookworm; `apt-get download` needs no installation):
    apt-get download dict-devil sword-text-web
    dpkg-deb -x dict-devil_*.deb /tmp/pd && dpkg-deb -x sword-text-web_*.deb /tmp/pd
    python tools/build_corpus.py --root /tmp/pd --out data/corpus

The SWORD "zText" format: `nt.bzs` is a table of (offset, compressed size, size) uint32 triples, one per block;
`nt.bzz` holds the zlib blocks; with BlockType=BOOK every block is one book in OSIS XML.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import struct
import zlib
from pathlib import Path

DEVIL_DIR = "usr/share/dictd"
WEB_DIR = "usr/share/sword/modules/texts/ztext/engWEB2015eb"
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _dictd_number(s: str) -> int:
    n = 0
    for ch in s:
        n = n * 64 + _B64.index(ch)
    return n


def devils_dictionary(root: Path) -> list[dict]:
    text = gzip.open(root / DEVIL_DIR / "devil.dict.dz", "rb").read()
    spans = set()
    for line in (root / DEVIL_DIR / "devil.index").read_text().splitlines():
        word, off, size = line.split("\t")
        if word.startswith("00database") and word != "00databaseinfo":
            continue
        spans.add((_dictd_number(off), _dictd_number(size), word))
    docs = []
    for off, size, word in sorted(spans):
        body = text[off:off + size].decode("utf-8").strip("\n")
        if word == "00databaseinfo":  # the edition notice and the author's preface
            body = body[body.index("THE DEVIL'S DICTIONARY"):]
            word = "preface"
        docs.append({"text": body, "title": f"The Devil's Dictionary: {word}", "source": "dict-devil"})
    return docs


def _osis_to_text(xml: str) -> str:
    xml = re.sub(r"<note\b.*?</note>", "", xml, flags=re.S)  # footnotes and cross references
    xml = re.sub(r'<div\b[^>]*eID="[^"]*"[^>]*type="x-p"[^>]*/>', "\n\n", xml)  # paragraph ends
    xml = re.sub(r"<l\b[^>]*eID[^>]*/>|</l>|<lb\b[^>]*/>", "\n", xml)  # poetry lines
    xml = re.sub(r"<title\b[^>]*>(.*?)</title>", r"\n\n\1\n\n", xml, flags=re.S)
    text = re.sub(r"<[^>]+>", "", xml)
    text = re.sub(r"([,;:.!?])(?=[A-Za-z])", r"\1 ", text)  # a removed footnote took the space after it
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def world_english_bible_nt(root: Path) -> list[dict]:
    d = root / WEB_DIR
    bzs, bzz = (d / "nt.bzs").read_bytes(), (d / "nt.bzz").read_bytes()
    docs = []
    for i in range(0, len(bzs), 12):
        off, csize, _ = struct.unpack("<III", bzs[i:i + 12])
        book = zlib.decompress(bzz[off:off + csize]).decode("utf-8")
        name = re.search(r'<milestone n="([^"]+)" type="x-usfm-h"/>', book)
        if name is None:  # importer and module headers, not a book
            continue
        # Each chapter opens with <chapter ... sID="Book.N"/>; the text before the first one is the book title.
        parts = re.split(r'<chapter\b[^>]*sID="[^".]+\.(\d+)"[^>]*/>', book)
        for num, body in zip(parts[1::2], parts[2::2]):
            text = _osis_to_text(body)
            if text:
                title = f"{name.group(1)} {num}"
                docs.append({"text": f"{title}\n\n{text}", "title": title, "source": "sword-text-web"})
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, required=True, help="directory the two .deb files were extracted into")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, docs in [("devils_dictionary", devils_dictionary(args.root)),
                       ("world_english_bible_nt", world_english_bible_nt(args.root))]:
        path = args.out / f"{name}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        print(f"{path}: {len(docs)} documents, {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
