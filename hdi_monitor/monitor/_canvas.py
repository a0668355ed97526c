"""Drawing on a palette canvas for the dashboard pictures (private to `hdi_monitor.monitor.render`):
cells upscaled by whole pixels, text pasted from cached glyphs of Pillow's default font, a few
canvas colours past the colour table's 256 entries."""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["FONT_PX", "NAN_RGB", "PNG_LEVEL", "SMALL_PX"]

#: Colour of NaN cells (invalid heads, layers not measured at a step): mid grey, in no colour table.
NAN_RGB = (128, 128, 128)
_BORDER_RGB = (150, 150, 150)
#: Text sizes in pixels: titles and labels, head indices.
FONT_PX, SMALL_PX = 13, 11
#: zlib level of the PNGs: 1 is the fastest; flat blocks of colour compress well at any level.
PNG_LEVEL = 1


# Canvas colours past the 256 table entries (see `_Canvas`).
_WHITE, _NAN, _BORDER, _INK = 256, 257, 258, 259
_INK_LEVELS = 7  # text anti-aliasing, quantised: _INK + k - 1 for k = 1..7 (7: black)
_EXTRAS = np.array(
    [(255, 255, 255), NAN_RGB, _BORDER_RGB]
    + [(255 - round(255 * k / _INK_LEVELS),) * 3 for k in range(1, _INK_LEVELS + 1)],
    dtype=np.uint8,
)
_BLACK = _INK + _INK_LEVELS - 1
#: ink mask value (0..255) -> quantised level (0..7)
_LEVEL = np.rint(np.arange(256) * _INK_LEVELS / 255).astype(np.uint16)


def _cells(index: np.ndarray) -> np.ndarray:
    """Canvas colours (uint16) of table entries: -1 (NaN) becomes `_NAN`."""
    return np.where(index < 0, _NAN, index).astype(np.uint16)


def _blocks(cells: np.ndarray, cell_h: int, cell_w: int, row_gap: int = 0, col_gap: int = 0) -> np.ndarray:
    """``(n, m)`` canvas colours upscaled to ``cell_h x cell_w`` blocks (nearest neighbour), with
    ``row_gap`` / ``col_gap`` white pixels between rows / columns of cells."""
    n, m = cells.shape
    blocks = np.full((n, cell_h + row_gap, m, cell_w + col_gap), _WHITE, dtype=np.uint16)
    blocks[:, :cell_h, :, :cell_w] = cells[:, None, :, None]
    out = blocks.reshape(n * (cell_h + row_gap), m * (cell_w + col_gap))
    return out[: out.shape[0] - row_gap, : out.shape[1] - col_gap]


# ---------------------------------------------------------------- text (cached glyphs)


_FONT_LOCK = threading.Lock()


@lru_cache(maxsize=8)
def _font(size: int) -> Any:
    """Pillow's default font at ``size`` px (a Pillow built without FreeType gives its 11 px bitmap font)."""
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


@lru_cache(maxsize=1024)
def _glyph(char: str, size: int) -> tuple[np.ndarray, float]:
    """Ink mask (uint8, 255 = ink) of one character drawn 1 px from the left, and its advance."""
    from PIL import Image, ImageDraw

    with _FONT_LOCK:  # a FreeType face is not to be used by two threads at once
        font = _font(size)
        if hasattr(font, "getmetrics"):  # FreeType
            ascent, descent = font.getmetrics()
        else:  # the bitmap font
            ascent, descent = font.getbbox("Ag|")[3], 2
        advance = float(font.getlength(char))
        if char == " ":  # the default font's space is narrow (2 px at 11 px): widen it for legibility
            advance = max(advance, round(size / 3))
        picture = Image.new("L", (math.ceil(advance) + 3, ascent + descent), 0)
        ImageDraw.Draw(picture).text((1, 0), char, font=font, fill=255)
    mask = np.asarray(picture).copy()
    mask.setflags(write=False)
    return mask, advance


@lru_cache(maxsize=4096)
def _text(text: str, size: int) -> np.ndarray:
    """Ink mask of a line of text (read-only), composed from cached glyphs (no kerning)."""
    glyphs = [_glyph(c, size) for c in text]
    height = glyphs[0][0].shape[0] if glyphs else _glyph(" ", size)[0].shape[0]
    width = math.ceil(sum(a for _, a in glyphs)) + 3
    ink = np.zeros((height, width), dtype=np.uint8)
    x = 0.0
    for mask, advance in glyphs:
        left = round(x)
        region = ink[:, left : left + mask.shape[1]]
        np.maximum(region, mask[:, : region.shape[1]], out=region)
        x += advance
    ink.setflags(write=False)
    return ink


def _text_width(text: str, size: int = FONT_PX) -> int:
    return int(_text(text, size).shape[1])


def _line_height(size: int) -> int:
    return int(_glyph(" ", size)[0].shape[0])


def _fit(text: str, width: int, size: int = FONT_PX, *, keep_end: bool = True) -> str:
    """``text`` cut with '...' until it is at most ``width`` pixels wide: from the left (``keep_end``:
    a layer name's last parts tell it apart), else from the right."""
    if _text_width(text, size) <= width:
        return text
    for cut in range(1, len(text)):
        short = "..." + text[cut:] if keep_end else text[: len(text) - cut] + "..."
        if _text_width(short, size) <= width:
            return short
    return "..."


def _wrap(text: str, width: int, size: int = FONT_PX) -> list[str]:
    """``text`` broken at spaces into lines at most ``width`` pixels wide (a longer word is cut)."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and _text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(_fit(word, width, size))
    return lines or [""]


class _Canvas:
    """A white canvas of colour numbers: 0..255 are entries of the picture's colour table, the rest
    white, NaN grey, border grey and 7 levels of text ink. Text is drawn over white only.

    `png` writes a palette PNG with exactly the colours used when they are at most 256 (the usual
    case: about 60 colour-bar entries, the cells' entries and 10 others), else an RGB PNG; the
    pixels are the same either way."""

    def __init__(self, width: int, height: int, table: np.ndarray) -> None:
        self.index = np.full((height, width), _WHITE, dtype=np.uint16)
        self.colours = np.concatenate([table, _EXTRAS])

    def paste(self, x: int, y: int, block: np.ndarray) -> None:
        self.index[y : y + block.shape[0], x : x + block.shape[1]] = block

    def box(self, x: int, y: int, width: int, height: int) -> None:
        """A 1-pixel border around the ``width x height`` box whose top-left pixel is ``(x, y)``."""
        self.index[y - 1, x - 1 : x + width + 1] = _BORDER
        self.index[y + height, x - 1 : x + width + 1] = _BORDER
        self.index[y - 1 : y + height + 1, x - 1] = _BORDER
        self.index[y - 1 : y + height + 1, x + width] = _BORDER

    def text(self, x: int, y: int, text: str, *, size: int = FONT_PX, align: str = "left", middle: bool = False) -> int:
        """Draw ``text`` with its top (or, ``middle``, its centre) at ``y``; ``align`` says where ``x``
        is: ``"left"``, ``"centre"`` or ``"right"``. Returns the text's width."""
        ink = _text(text, size)
        h, w = ink.shape
        x0 = x - {"left": 0, "centre": w // 2, "right": w}[align]
        y0 = y - h // 2 if middle else y
        ys, xs = max(0, -y0), max(0, -x0)
        region = self.index[y0 + ys : y0 + h, x0 + xs : x0 + w]
        level = _LEVEL[ink[ys : ys + region.shape[0], xs : xs + region.shape[1]]]
        np.copyto(region, _INK - 1 + level, where=level > 0)
        return int(w)

    def rgb(self) -> np.ndarray:
        """``(height, width, 3)`` uint8 pixels."""
        return self.colours[self.index]

    def png(self) -> bytes:
        from PIL import Image

        used = np.flatnonzero(np.bincount(self.index.ravel(), minlength=len(self.colours)))
        if len(used) <= 256:
            number = np.zeros(len(self.colours), dtype=np.uint8)
            number[used] = np.arange(len(used), dtype=np.uint8)
            height, width = self.index.shape
            picture = Image.frombytes("P", (width, height), number[self.index].tobytes())
            picture.putpalette(self.colours[used].tobytes())
        else:
            picture = Image.fromarray(self.rgb(), "RGB")
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG", compress_level=PNG_LEVEL)
        return buffer.getvalue()


def _tick_positions(count: int, *, slots: int) -> list[int]:
    """About ``slots`` evenly spread indices of ``range(count)``: the first, and the last unless it crowds."""
    if count <= slots:
        return list(range(count))
    step = math.ceil((count - 1) / max(slots - 1, 1))
    picks = list(range(0, count, step))
    if count - 1 - picks[-1] >= step / 2:  # the last index too, unless it would crowd its neighbour
        picks.append(count - 1)
    return picks


def layer_labels(names: Sequence[str]) -> tuple[list[str], str]:
    """Short labels for layer names, and the pattern they fill in.

    The longest common dotted prefix and suffix are cut: ``encoder.layer.0.attention``,
    ``encoder.layer.1.attention`` give labels ``0``, ``1`` and pattern ``encoder.layer.*.attention``.
    """
    names = [n or "<root>" for n in names]
    if len(names) < 2:
        return names, ""
    parts = [n.split(".") for n in names]
    pre = 0
    while all(len(p) > pre + 1 for p in parts) and len({p[pre] for p in parts}) == 1:
        pre += 1
    suf = 0
    while all(len(p) > pre + suf + 1 for p in parts) and len({p[-1 - suf] for p in parts}) == 1:
        suf += 1
    labels = [".".join(p[pre : len(p) - suf]) for p in parts]
    if len(set(labels)) != len(labels) or (pre == 0 and suf == 0):
        return names, ""
    pattern = ".".join([*parts[0][:pre], "*", *(parts[0][len(parts[0]) - suf :] if suf else [])])
    return labels, pattern


def _bar(length: int) -> np.ndarray:
    """A colour bar of ``length`` pixels, table entry 0 first: 64 bands of even steps through the
    table (entries ``round(255 k / 63)``), so that the picture's colours fit one PNG palette."""
    return np.rint(np.floor(np.linspace(0, 64, length, endpoint=False)) * 255 / 63).astype(np.uint16)


def _number(value: float) -> str:
    return f"{value:g}"


def _nan_legend(canvas: _Canvas, x: int, y: int, what: str) -> int:
    """A grey swatch and ``grey: <what>`` at ``(x, y)``; returns the width used."""
    size = SMALL_PX + 1
    canvas.paste(x, y, np.full((size, size), _NAN, dtype=np.uint16))
    return size + 4 + canvas.text(x + size + 4, y + size // 2, f"grey: {what}", size=SMALL_PX, middle=True)


# ---------------------------------------------------------------- the pictures
