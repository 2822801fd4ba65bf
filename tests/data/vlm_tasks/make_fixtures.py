"""Write the VLM benchmark fixtures: a few made-up rows per benchmark in the Hub dataset's schema.

``python tests/data/vlm_tasks/make_fixtures.py`` rewrites ``<task>.parquet`` here. Each file has
the columns and feature types of the split kvlab's loader reads by default (lmms-lab/DocVQA
``DocVQA`` validation, lmms-lab/ChartQA test, lmms-lab/textvqa validation, echo840/OCRBench
test, lmms-lab/MMMU validation), written with the ``datasets`` features in the parquet
metadata, as the Hub's parquet exports are; the questions, answers and images are invented.
"""

from pathlib import Path

import datasets
from datasets import Features, Image, Sequence, Value
from PIL import Image as PILImage
from PIL import ImageDraw

HERE = Path(__file__).parent
TEXT = Value("string")


def picture(text: str, colour: str) -> PILImage.Image:
    """A small image with a coloured band and a word drawn on it."""
    image = PILImage.new("RGB", (64, 40), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, 63, 9), fill=colour)
    draw.text((4, 16), text, fill="black")
    return image


def write(name: str, rows: dict, features: Features) -> None:
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(HERE / f"{name}.parquet"))


def main() -> None:
    write(
        "docvqa",
        {
            "questionId": ["49153", "49154", "57349"],
            "question": ["What is the date on the form?", "Who signed the letter?", "What is the total?"],
            "question_types": [["form"], ["handwritten"], ["table/list"]],
            "image": [picture("1/2/99", "gray"), picture("1/2/99", "gray"), picture("$12", "blue")],
            "docId": [14465, 14465, 16731],
            "ucsf_document_id": ["pybv0228", "pybv0228", "qzdw0217"],
            "ucsf_document_page_no": ["81", "81", "3"],
            "answers": [["1/2/99", "January 2, 1999"], ["J. Smith"], ["$12.00", "12"]],
            "data_split": ["val", "val", "val"],
        },
        Features(
            questionId=TEXT,
            question=TEXT,
            question_types=Sequence(TEXT),
            image=Image(),
            docId=Value("int64"),
            ucsf_document_id=TEXT,
            ucsf_document_page_no=TEXT,
            answers=Sequence(TEXT),
            data_split=TEXT,
        ),
    )
    write(
        "chartqa",
        {
            "type": ["human_test", "augmented_test", "human_test"],
            "question": [
                "Which year had the most sales?",
                "What is the value of Italy?",
                "Is the line rising?",
            ],
            "answer": ["2019", "45%", "Yes"],
            "image": [picture("2019", "red"), picture("45%", "green"), picture("up", "red")],
        },
        Features(type=TEXT, question=TEXT, answer=TEXT, image=Image()),
    )
    write(
        "textvqa",
        {
            "image_id": ["003a8ae2ef43b901", "003a8ae2ef43b901", "00685bc495504d61"],
            "question_id": [34602, 34603, 34604],
            "question": [
                "what is the brand of this camera?",
                "what does the small text say?",
                "what number is this?",
            ],
            "question_tokens": [["what", "is", "the", "brand"], ["what", "does"], ["what", "number"]],
            "image": [picture("dakota", "black"), picture("dakota", "black"), picture("14", "orange")],
            "image_width": [1024, 1024, 800],
            "image_height": [664, 664, 600],
            "flickr_original_url": ["", "", ""],
            "flickr_300k_url": ["", "", ""],
            "answers": [
                ["nous les gosses"] * 3 + ["dakota"] * 6 + ["clos culombu"],
                ["dakota"] * 10,
                ["14"] * 8 + ["fourteen", "1"],
            ],
            "image_classes": [["Camera"], ["Camera"], ["Sign"]],
            "set_name": ["val", "val", "val"],
            "ocr_tokens": [["dakota"], ["dakota"], ["14"]],
        },
        Features(
            image_id=TEXT,
            question_id=Value("int64"),
            question=TEXT,
            question_tokens=Sequence(TEXT),
            image=Image(),
            image_width=Value("int64"),
            image_height=Value("int64"),
            flickr_original_url=TEXT,
            flickr_300k_url=TEXT,
            answers=Sequence(TEXT),
            image_classes=Sequence(TEXT),
            set_name=TEXT,
            ocr_tokens=Sequence(TEXT),
        ),
    )
    write(
        "ocrbench",
        {
            "dataset": ["IIIT5K", "HME100k", "FUNSD"],
            "question": [
                "what is written in the image?",
                "Please write out the expression of the formula in the image using LaTeX format.",
                "What is the date?  ",
            ],
            "question_type": [
                "Regular Text Recognition",
                "Handwritten Mathematical Expression Recognition",
                "Key Information Extraction",
            ],
            "answer": [["Hello"], ["x^{2}+1"], ["12/03/1998"]],
            "image": [picture("Hello", "white"), picture("x2+1", "white"), picture("12/03", "yellow")],
        },
        Features(dataset=TEXT, question=TEXT, question_type=TEXT, answer=Sequence(TEXT), image=Image()),
    )
    images = {f"image_{i}": [None, None, None] for i in range(1, 8)}
    images["image_1"] = [picture("cell", "green"), picture("graph", "blue"), picture("map", "gray")]
    images["image_2"] = [None, picture("axis", "red"), None]
    write(
        "mmmu",
        {
            "id": ["validation_Biology_1", "validation_Math_2", "validation_Geography_3"],
            "question": [
                "<image 1> Which organelle is shown?",
                "Compare <image 1> and <image 2>: what is the slope?",
                "<image 1> Which continent is highlighted?",
            ],
            "options": [
                "['Nucleus', 'Ribosome', 'Mitochondrion', 'Golgi apparatus']",
                "[]",
                "['Asia', 'Africa', 'Europe']",
            ],
            "explanation": ["", "", ""],
            **images,
            "img_type": ["['Microscopic Photos']", "['Plots and Charts']", "['Maps']"],
            "answer": ["C", "2.5", "B"],
            "topic_difficulty": ["Easy", "Medium", "Easy"],
            "question_type": ["multiple-choice", "open", "multiple-choice"],
            "subfield": ["Cell Biology", "Calculus", "Physical Geography"],
        },
        Features(
            id=TEXT,
            question=TEXT,
            options=TEXT,
            explanation=TEXT,
            **{f"image_{i}": Image() for i in range(1, 8)},
            img_type=TEXT,
            answer=TEXT,
            topic_difficulty=TEXT,
            question_type=TEXT,
            subfield=TEXT,
        ),
    )


if __name__ == "__main__":
    main()
