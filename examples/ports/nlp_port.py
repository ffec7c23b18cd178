"""A plain PyTorch fine-tuning loop in the shape of Hugging Face's nlp example: a tiny BERT classifier.

The model is built from a small transformers config and the data set is synthetic token ids
(a sequence is positive when it holds the marker token), so nothing is downloaded.
nlp_port.py is this script ported to stratagem; `diff -u nlp_original.py nlp_port.py` shows how.

    python examples/ports/nlp_original.py --num-epochs 2
"""
import argparse

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

import stratagem as sg

VOCAB_SIZE = 64
MARKER = 3
PAD = 0


def synthetic_dataset(num_examples, seed, max_length=16):
    """Tokenized examples of random length; label 1 when the marker token occurs in the sequence."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(num_examples):
        length = int(torch.randint(4, max_length + 1, (1,), generator=generator))
        input_ids = torch.randint(MARKER + 1, VOCAB_SIZE, (length,), generator=generator)
        label = int(torch.randint(0, 2, (1,), generator=generator))
        if label:
            input_ids[int(torch.randint(0, length, (1,), generator=generator))] = MARKER
        examples.append({"input_ids": input_ids, "labels": label})
    return examples


def collate_fn(examples):
    """Pads each batch to its longest sequence, as a tokenizer's padding collator does."""
    longest = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), longest), PAD, dtype=torch.int64)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.int64)
    for i, e in enumerate(examples):
        input_ids[i, : len(e["input_ids"])] = e["input_ids"]
        attention_mask[i, : len(e["input_ids"])] = 1
    labels = torch.tensor([e["labels"] for e in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def get_dataloaders(batch_size, eval_batch_size, seed, num_train=512, num_eval=128):
    shuffle = torch.Generator().manual_seed(seed)
    train_dataloader = DataLoader(synthetic_dataset(num_train, seed=1), shuffle=True, generator=shuffle,
                                  collate_fn=collate_fn, batch_size=batch_size)
    eval_dataloader = DataLoader(synthetic_dataset(num_eval, seed=2), shuffle=False, collate_fn=collate_fn,
                                 batch_size=eval_batch_size)
    return train_dataloader, eval_dataloader


def tiny_bert():
    config = BertConfig(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, pad_token_id=PAD)
    return BertForSequenceClassification(config)


def training_function(config, args):
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    strategy = sg.strategy_from_env()
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    torch.manual_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(batch_size, batch_size * 2, seed, int(config["train_examples"]))
    model = tiny_bert()
    model = model.to(device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    model, optimizer = strategy.distribute(model, optimizer)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=len(train_dataloader) // 4,
        num_training_steps=len(train_dataloader) * num_epochs,
    )
    lr_scheduler = strategy.distribute_scheduler(lr_scheduler)

    for epoch in range(num_epochs):
        model.train()
        @strategy.step
        def train_step(batch):
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

        for step, batch in enumerate(train_dataloader):
            train_step(batch)

        model.eval()
        all_predictions, all_labels = [], []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = strategy.step(model, returns="gather")(**batch)
            all_predictions.append(outputs.logits.argmax(dim=-1))
            all_labels.append(batch["labels"])
        accuracy = (torch.cat(all_predictions) == torch.cat(all_labels)).float().mean().item()
        strategy.print(f"epoch {epoch}: accuracy {accuracy:.4f}")


def main():
    parser = argparse.ArgumentParser(description="A tiny BERT sequence classifier, trained from scratch.")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is available")
    parser.add_argument("--num-epochs", type=int, default=3, help="number of epochs (default: 3)")
    parser.add_argument("--batch-size", type=int, default=16, help="training batch size (default: 16)")
    parser.add_argument("--train-examples", type=int, default=512, help="size of the training set (default: 512)")
    args = parser.parse_args()
    config = {"lr": 3e-3, "num_epochs": args.num_epochs, "seed": 42, "batch_size": args.batch_size,
              "train_examples": args.train_examples}
    training_function(config, args)


if __name__ == "__main__":
    main()
