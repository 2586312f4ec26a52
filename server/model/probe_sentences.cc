#include "server/model/probe_sentences.h"

namespace collabserve::model {

const std::vector<std::string>& BuiltinProbeSentences() {
  static const std::vector<std::string> kSentences = {
      "The movie was a complete waste of time and money.",
      "I absolutely loved the performance; the cast was brilliant.",
      "The package arrived two days late and the box was damaged.",
      "Customer support resolved my issue within minutes.",
      "It's fine, I guess, nothing special.",
      "Stocks fell sharply after the central bank raised interest rates.",
      "The new phone's battery lasts all day, even with heavy use.",
      "Please reset my password; I can no longer log in.",
      "What time does the museum open on Sundays?",
      "The recipe needs two cups of flour and a pinch of salt.",
      "Scientists discovered a new species of frog in the rainforest.",
      "Traffic on the highway was backed up for miles this morning.",
      "I would not recommend this hotel to anyone.",
      "The lecture on quantum computing was surprisingly accessible.",
      "Our flight was cancelled and no one told us why.",
      "This is the best coffee I have had in years!",
      "The court ruled that the contract was void.",
      "He scored twice in the final ten minutes to win the match.",
      "The software update broke the printer driver again.",
      "Thank you so much for the thoughtful gift.",
      "Heavy rain is expected across the region through Thursday.",
      "The instructions were confusing and incomplete.",
      "She finished the marathon in under three hours.",
      "Can you recommend a good book about ancient Rome?",
      "The restaurant's service was slow but the food was excellent.",
      "Prices have gone up again, and quality has gone down.",
      "The committee approved the budget after a long debate.",
      "My laptop overheats whenever I open more than two tabs.",
      "What a wonderful surprise to see you here!",
      "The bridge will be closed for repairs until next spring.",
      "I am not sure whether this product is worth the price.",
      "Terrible acting, predictable plot, and far too long.",
  };
  return kSentences;
}

}  // namespace collabserve::model
