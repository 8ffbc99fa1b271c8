"""Tiny copies of the image datasets, written in the real on-disk formats that torchvision reads,
so the real loaders run offline in a second."""

import pickle

import numpy as np
from PIL import Image

CIFAR_TRAIN, CIFAR_TEST, CIFAR_CLASSES_USED = 200, 100, 20
CALTECH_CATEGORIES = ("Faces_easy", "Leopards", "accordion", "airplanes", "anchor")  # sorted, as torchvision lists them
CALTECH_PER_CATEGORY = 12
INATURALIST_CATEGORIES = (  # <id>_<kingdom>_<phylum>_<class>_<order>_<family>_<genus>_<species>
    "00000_Animalia_Chordata_Aves_Passeriformes_Corvidae_Corvus_corax",
    "00001_Fungi_Basidiomycota_Agaricomycetes_Agaricales_Amanitaceae_Amanita_muscaria",
    "00002_Fungi_Basidiomycota_Agaricomycetes_Boletales_Boletaceae_Boletus_edulis",
    "00003_Fungi_Ascomycota_Pezizomycetes_Pezizales_Morchellaceae_Morchella_esculenta",
    "00004_Plantae_Tracheophyta_Magnoliopsida_Rosales_Rosaceae_Rosa_canina",
)
INATURALIST_PER_SPECIES = {"2021_train_mini": 10, "2021_valid": 4}
# iNaturalist 2018: <super-category>/<category id>/, ids numbered across super-categories
INATURALIST_2018_CATEGORIES = {"Aves": (0, 3), "Fungi": (4, 1, 2), "Plantae": (5,)}
INATURALIST_2018_PER_SPECIES = 20
OTHER_KINGDOM_GRAY = 240  # the non-Fungi images are near white


def fungi_gray(label: int) -> int:
    """The gray level of every image of Fungi species ``label``: a served image shows its class."""
    return 40 + 50 * label


def cifar_labels(count: int) -> np.ndarray:
    # every fifth of the 100 classes, so the labels are valid but not 0..K-1
    return (np.arange(count) % CIFAR_CLASSES_USED) * 5


def write_cifar100(root, seed=0, train=CIFAR_TRAIN, test=CIFAR_TEST):
    """``<root>/cifar-100-python/{train,test,meta}``: Python-2-style pickles with bytes keys and
    ``data`` rows of 3072 bytes (red, green, blue planes), ``train`` and ``test`` images (the real
    set's 50000 and 10000 for bench/gpu_check.py).  Returns the images as ``[N, 3, 32, 32]``."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    images = {}
    for name, count in (("train", train), ("test", test)):
        data = rng.integers(0, 256, size=(count, 3072), dtype=np.uint8)
        labels = cifar_labels(count)
        entry = {
            b"filenames": [f"image_{i}.png".encode() for i in range(count)],
            b"batch_label": f"{name}ing batch 1 of 1".encode(),
            b"fine_labels": labels.tolist(),
            b"coarse_labels": (labels // 5).tolist(),
            b"data": data,
        }
        (folder / name).write_bytes(pickle.dumps(entry))
        images[name] = data.reshape(count, 3, 32, 32)
    meta = {b"fine_label_names": [f"class{i}".encode() for i in range(100)], b"coarse_label_names": [f"super{i}".encode() for i in range(20)]}
    (folder / "meta").write_bytes(pickle.dumps(meta))
    return images


def write_jpeg(path, pixels):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, "JPEG", quality=95)


def write_caltech101(root, seed=0):
    """``<root>/caltech101/101_ObjectCategories/<category>/image_NNNN.jpg`` with random images of
    assorted sizes (one grayscale image per category, as in the real data), plus the
    ``BACKGROUND_Google`` folder that is not a class."""
    rng = np.random.default_rng(seed)
    folder = root / "caltech101" / "101_ObjectCategories"
    for category in ("BACKGROUND_Google", *CALTECH_CATEGORIES):
        for number in range(1, CALTECH_PER_CATEGORY + 1):
            height, width = rng.integers(24, 64, size=2)
            shape = (height, width) if number == 1 else (height, width, 3)
            write_jpeg(folder / category / f"image_{number:04d}.jpg", rng.integers(0, 256, size=shape, dtype=np.uint8))


def write_inaturalist2021(root):
    """``<root>/2021_train_mini`` and ``<root>/2021_valid``, each with one folder per species (three
    Fungi, one animal, one plant) of flat gray JPEGs: ``fungi_gray(label)`` for Fungi species
    ``label``, near white otherwise."""
    fungi = [name for name in INATURALIST_CATEGORIES if name.split("_")[1] == "Fungi"]
    for version, count in INATURALIST_PER_SPECIES.items():
        for category in INATURALIST_CATEGORIES:
            gray = fungi_gray(fungi.index(category)) if category in fungi else OTHER_KINGDOM_GRAY
            for number in range(count):
                write_jpeg(root / version / category / f"{category[:5]}-{number:08x}.jpg", np.full((40, 30, 3), gray, dtype=np.uint8))


def write_inaturalist2018(root):
    """``<root>/2018/<super-category>/<category id>/<name>.jpg``, torchvision's layout of
    ``train_val2018``: three Fungi categories among others, flat gray JPEGs as above, where Fungi
    label ``k`` is the ``k``-th Fungi category id in numeric order (ids 1, 2, 4 -> 0, 1, 2)."""
    fungi = sorted(INATURALIST_2018_CATEGORIES["Fungi"])
    for super_category, categories in INATURALIST_2018_CATEGORIES.items():
        for category in categories:
            gray = fungi_gray(fungi.index(category)) if super_category == "Fungi" else OTHER_KINGDOM_GRAY
            for number in range(INATURALIST_2018_PER_SPECIES):
                write_jpeg(root / "2018" / super_category / str(category) / f"{number:032x}.jpg", np.full((30, 40, 3), gray, dtype=np.uint8))
